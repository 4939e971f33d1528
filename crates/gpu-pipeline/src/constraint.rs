//! Constrained decoding: a [`Constraint`] says which tokens may come next (a grammar, a JSON
//! Schema, a tool-call format) and follows the tokens sampled. The engine asks it for a
//! [`TokenMask`] before sampling each token of a constrained sequence and samples through
//! [`Sampler::sample_masked`](crate::Sampler::sample_masked), so the sequence never leaves the
//! language; its batch neighbours sample as before.

use std::fmt::Debug;

use crate::sampling::TokenMask;

/// Why a constraint could not go on.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConstraintError {
    /// The constraint allows no token that the model gives a finite logit.
    #[error("the output constraint allows no token here")]
    NoAllowedToken,
    /// The constraint itself failed (its grammar engine's message).
    #[error("the output constraint failed: {0}")]
    Failed(String),
}

/// The state of one sequence's output constraint.
pub trait Constraint: Send + Debug {
    /// Sets `mask` to the tokens allowed next (the end-of-sequence token when the output so
    /// far is complete). `mask` covers the model's vocabulary.
    fn fill_mask(&mut self, mask: &mut TokenMask) -> Result<(), ConstraintError>;
    /// Advances past `token`, which the last mask allowed.
    fn commit(&mut self, token: u32) -> Result<(), ConstraintError>;
}

/// Makes the [`Constraint`] of each sequence of a request (a request is cloned and may be
/// preempted; the state lives with its sequence).
pub trait ConstraintFactory: Send + Sync + Debug {
    /// A constraint in its start state.
    fn start(&self) -> Box<dyn Constraint>;
}

/// A sequence's constraint and its mask (allocated once, refilled each step).
#[derive(Debug)]
pub(crate) struct Constrained {
    pub(crate) state: Box<dyn Constraint>,
    pub(crate) mask: TokenMask,
}

impl Constrained {
    pub(crate) fn new(factory: &dyn ConstraintFactory, vocab: usize) -> Self {
        Self {
            state: factory.start(),
            mask: TokenMask::forbid_all(vocab),
        }
    }
}
