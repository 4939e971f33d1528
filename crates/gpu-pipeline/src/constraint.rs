//! Constrained decoding: a [`Constraint`] says which tokens may come next (a grammar, a JSON
//! Schema, a tool-call format) and follows the tokens sampled. The engine asks it for a
//! [`TokenMask`] before sampling each token of a constrained sequence and samples through
//! [`Sampler::sample_masked`](crate::Sampler::sample_masked), so the sequence never leaves the
//! language; its batch neighbours sample as before.
//!
//! The mask of a step depends only on the tokens sampled before it, so the engine fills the
//! masks of a step's constrained sequences on a helper thread ([`MaskFiller`]) while the forward
//! pass runs, and sampling finds them ready: a constrained sequence costs its batch neighbours
//! only the time its mask takes beyond the forward pass.

use std::fmt::Debug;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex, PoisonError};

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
    /// How many of `tokens`, taken in order from the current state, the constraint allows,
    /// without advancing: speculative decoding cuts a draft there, so that it does not spend
    /// the target model's verification on tokens the constraint forbids. The default allows
    /// them all (the verification samples every drafted position through the mask anyway, so
    /// a forbidden draft token is rejected there, at the cost of verifying it).
    fn allowed_prefix(&mut self, tokens: &[u32]) -> usize {
        tokens.len()
    }
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
    mask: TokenMask,
    /// `Some`: `mask` was filled ahead for the next sample (or filling it failed).
    filled: Option<Result<(), ConstraintError>>,
}

/// A sequence's [`Constrained`], shared with the [`MaskFiller`] for the length of a step.
pub(crate) type SharedConstrained = Arc<Mutex<Constrained>>;

impl Constrained {
    pub(crate) fn new(factory: &dyn ConstraintFactory, vocab: usize) -> SharedConstrained {
        Arc::new(Mutex::new(Self {
            state: factory.start(),
            mask: TokenMask::forbid_all(vocab),
            filled: None,
        }))
    }

    /// Fills the mask of the next sample ahead of it (a panicking constraint fails its
    /// sequence, not the filling thread).
    fn fill_ahead(&mut self) {
        let Self { state, mask, .. } = self;
        let r = catch_unwind(AssertUnwindSafe(|| state.fill_mask(mask)));
        self.filled =
            Some(r.unwrap_or_else(|_| {
                Err(ConstraintError::Failed("the constraint panicked".into()))
            }));
    }

    /// The mask of this sample: the one filled ahead, or else filled now.
    pub(crate) fn mask(&mut self) -> Result<&TokenMask, ConstraintError> {
        match self.filled.take() {
            Some(r) => r?,
            None => self.state.fill_mask(&mut self.mask)?,
        }
        Ok(&self.mask)
    }
}

/// Locks a sequence's constraint (a panic while it was held left no broken invariant: the
/// next mask is refilled).
pub(crate) fn lock(c: &SharedConstrained) -> std::sync::MutexGuard<'_, Constrained> {
    c.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A helper thread that fills the masks of a step's constrained sequences while the forward
/// pass runs: [`begin`](Self::begin) before the pass, [`finish`](Self::finish) after it. The
/// thread is started once and ends when the filler is dropped.
#[derive(Debug)]
pub(crate) struct MaskFiller {
    jobs: SyncSender<Vec<SharedConstrained>>,
    done: Receiver<Vec<SharedConstrained>>,
}

impl MaskFiller {
    /// Starts the helper thread.
    pub(crate) fn start() -> std::io::Result<Self> {
        let (jobs, todo) = sync_channel::<Vec<SharedConstrained>>(1);
        let (finished, done) = sync_channel(1);
        std::thread::Builder::new()
            .name("zerolayer-masks".into())
            .spawn(move || {
                for batch in todo {
                    for c in &batch {
                        lock(c).fill_ahead();
                    }
                    if finished.send(batch).is_err() {
                        return;
                    }
                }
            })?;
        Ok(Self { jobs, done })
    }

    /// Starts filling the masks of `batch`; returns at once. `false`: the thread is gone and
    /// the masks will be filled at sampling time.
    pub(crate) fn begin(&self, batch: Vec<SharedConstrained>) -> bool {
        self.jobs.send(batch).is_ok()
    }

    /// Waits until the batch given to the last [`begin`](Self::begin) is filled.
    pub(crate) fn finish(&self) {
        // A dead thread fills nothing: the masks are then filled at sampling time.
        let _ = self.done.recv();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Allows token `calls % vocab` and counts its fills; panics on fill `panic_at`.
    #[derive(Debug)]
    struct Counting {
        calls: Arc<Mutex<usize>>,
        panic_at: usize,
    }

    impl Constraint for Counting {
        fn fill_mask(&mut self, mask: &mut TokenMask) -> Result<(), ConstraintError> {
            let n = {
                let mut calls = self.calls.lock().unwrap();
                *calls += 1;
                *calls
            };
            assert!(n != self.panic_at, "fill {n}");
            mask.words_mut().fill(0);
            mask.words_mut()[0] = 1 << (n % 32);
            Ok(())
        }
        fn commit(&mut self, _: u32) -> Result<(), ConstraintError> {
            Ok(())
        }
    }

    /// The one token a [`Counting`] mask allows.
    fn allowed(c: &SharedConstrained) -> Result<u32, ConstraintError> {
        let mut c = lock(c);
        let m = c.mask()?;
        assert_eq!(m.count_allowed(), 1);
        Ok((0..64).find(|&t| m.is_allowed(t)).unwrap())
    }

    fn constrained(calls: &Arc<Mutex<usize>>, panic_at: usize) -> SharedConstrained {
        Arc::new(Mutex::new(Constrained {
            state: Box::new(Counting {
                calls: calls.clone(),
                panic_at,
            }),
            mask: TokenMask::forbid_all(64),
            filled: None,
        }))
    }

    #[test]
    fn masks_filled_ahead_are_used_once_and_a_panic_fails_only_its_sequence() {
        let filler = MaskFiller::start().unwrap();
        let (a_calls, b_calls) = (Arc::default(), Arc::default());
        let (a, b) = (constrained(&a_calls, 0), constrained(&b_calls, 1));
        assert!(filler.begin(vec![a.clone(), b.clone()]));
        filler.finish();
        assert_eq!((*a_calls.lock().unwrap(), *b_calls.lock().unwrap()), (1, 1));
        // The mask filled ahead is the one sampled with, without another fill...
        assert_eq!(allowed(&a), Ok(1));
        assert_eq!(*a_calls.lock().unwrap(), 1);
        // ... and only once: the next sample fills its own.
        assert_eq!(allowed(&a), Ok(2));
        assert_eq!(*a_calls.lock().unwrap(), 2);
        assert_eq!(
            allowed(&b),
            Err(ConstraintError::Failed("the constraint panicked".into()))
        );
        // The thread survived the panic.
        assert!(filler.begin(vec![a.clone()]));
        filler.finish();
        assert_eq!(allowed(&a), Ok(3));
    }
}
