//! The draft model of [`Speculation::DraftModel`](super::Speculation::DraftModel): before a
//! step, every sequence that may draft ([`Active::draft_want`]) has the text its draft ring has
//! not seen fed to the draft model (the whole prompt the first time, afterwards the tokens of
//! the last step), in chunks batched across the sequences; then the draft model decodes
//! greedily, all drafting sequences in one forward pass per draft token, until a sequence has
//! its budget, its ring is full, or its top token's probability falls under the cut-off. The
//! proposals go to each sequence's [`SpecState::proposal`](super::SpecState), verified by the
//! target like lookup's; [`Active::finish_step`] rolls the draft ring back to the accepted text.
//!
//! Failures never reach a request: a draft ring that cannot be allocated (the draft pool's
//! budget) or a draft forward pass that fails leaves the sequence decoding without drafts.

use std::sync::Arc;

use kv_ring::{HostKv, KvPool, KvStorage, RingMode};

use super::speculate::DraftModel;
use super::{Active, EngineConfig, EngineInitError};
use crate::constraint::lock;
use crate::model::{LogitsWanted, Model, ModelConfig, SeqStep};
use crate::sampling::top_token;

/// Most unseen tokens of one sequence fed to the draft model per forward pass.
const CATCH_UP_CHUNK: usize = 256;

/// The draft model, its KV pool and its logits buffer.
pub(crate) struct Drafter {
    model: Arc<Model>,
    pool: Arc<KvPool<HostKv>>,
    min_probability: f32,
    max_draft: usize,
    logits: Vec<f32>,
}

impl Drafter {
    /// The drafter of `d` for a target model of configuration `target`, with the engine's KV
    /// element type.
    pub(crate) fn new(
        d: &DraftModel,
        target: &ModelConfig,
        cfg: &EngineConfig,
    ) -> Result<Self, EngineInitError> {
        let vocab = d.model.config().vocab_size;
        if vocab != target.vocab_size {
            return Err(EngineInitError::DraftVocabulary {
                draft: vocab,
                model: target.vocab_size,
            });
        }
        let pool = KvPool::with_layer_windows(
            d.model.kv_shape(cfg.kv_dtype),
            d.kv_budget_bytes,
            d.model.kv_windows(),
            CATCH_UP_CHUNK.max(d.max_draft),
        )?;
        Ok(Self {
            model: d.model.clone(),
            pool,
            min_probability: d.min_probability,
            max_draft: d.max_draft.max(1),
            logits: Vec::new(),
        })
    }

    /// Proposes the drafts of every sequence of `seqs` whose `draft_want` is set (see the
    /// module docs).
    pub(crate) fn draft<'a, 't: 'a, S: KvStorage + 'a>(
        &mut self,
        seqs: impl Iterator<Item = &'a mut Active<'t, S>>,
        batch: usize,
    ) {
        // The cut-off in a batch of `batch` decoding sequences (`DraftModel::max_batch`).
        let cut = super::speculate::odds_bar(self.min_probability, batch);
        let mut want: Vec<&mut Active<'t, S>> = seqs.filter(|a| a.draft_want > 0).collect();
        want.retain_mut(|a| self.ready(a));
        if want.is_empty() {
            return;
        }
        // Catch up: whole chunks first (no logits), then the rest with the last row's logits.
        loop {
            let mut steps: Vec<SeqStep<'_, HostKv>> = want
                .iter_mut()
                .filter_map(|a| {
                    let Active {
                        history, draft_kv, ..
                    } = &mut **a;
                    let kv = draft_kv.as_mut()?;
                    let fed = kv.next_pos() as usize;
                    (history.len() - fed > CATCH_UP_CHUNK).then(|| SeqStep {
                        tokens: &history[fed..fed + CATCH_UP_CHUNK],
                        kv,
                        logits: LogitsWanted::None,
                    })
                })
                .collect();
            if steps.is_empty() {
                break;
            }
            if let Err(e) = self.model.forward(&mut steps, &mut self.logits) {
                drop(steps);
                return self.fail(&mut want, &e);
            }
        }
        let mut steps: Vec<SeqStep<'_, HostKv>> = want
            .iter_mut()
            .map(|a| {
                let Active {
                    history, draft_kv, ..
                } = &mut **a;
                let kv = draft_kv.as_mut().expect("kept by `ready`");
                let fed = kv.next_pos() as usize;
                SeqStep {
                    tokens: &history[fed..],
                    kv,
                    logits: LogitsWanted::Last,
                }
            })
            .collect();
        if let Err(e) = self.model.forward(&mut steps, &mut self.logits) {
            drop(steps);
            return self.fail(&mut want, &e);
        }
        drop(steps);
        // Draft tokens: `live[row]` is the sequence whose logits are row `row`.
        let vocab = self.model.config().vocab_size;
        let mut live: Vec<usize> = (0..want.len()).collect();
        loop {
            let mut next = Vec::with_capacity(live.len());
            for (row, &i) in live.iter().enumerate() {
                let (token, p) = top_token(&self.logits[row * vocab..(row + 1) * vocab]);
                // A row without a finite maximum (NaN probability) stops the draft too.
                if p.is_nan() || p < cut {
                    continue;
                }
                let a = &mut *want[i];
                let sp = a.spec.as_mut().expect("drafting sequences speculate");
                sp.proposal.push(token);
                // A token the request's constraint forbids ends the draft before it.
                if let Some(c) = &a.constrained
                    && lock(c).state.allowed_prefix(&sp.proposal) < sp.proposal.len()
                {
                    sp.proposal.pop();
                    continue;
                }
                let kv = a.draft_kv.as_ref().expect("kept by `ready`");
                if sp.proposal.len() < a.draft_want && (kv.next_pos() as usize) < kv.capacity() {
                    next.push(i);
                }
            }
            if next.is_empty() {
                return;
            }
            let mut steps: Vec<SeqStep<'_, HostKv>> = Vec::with_capacity(next.len());
            let mut k = 0;
            for (i, a) in want.iter_mut().enumerate() {
                if next.get(k) != Some(&i) {
                    continue;
                }
                k += 1;
                let Active { spec, draft_kv, .. } = &mut **a;
                let proposal = &spec
                    .as_ref()
                    .expect("drafting sequences speculate")
                    .proposal;
                steps.push(SeqStep {
                    tokens: &proposal[proposal.len() - 1..],
                    kv: draft_kv.as_mut().expect("kept by `ready`"),
                    logits: LogitsWanted::Last,
                });
            }
            if let Err(e) = self.model.forward(&mut steps, &mut self.logits) {
                drop(steps);
                // The proposals so far stand; the rings are fed again next time.
                for &i in &next {
                    want[i].draft_kv = None;
                }
                tracing::warn!("draft model: {e}; drafting again from the next step");
                return;
            }
            live = next;
        }
    }

    /// Gets `a` a draft ring that has room for its text and drafts (a new one when it has none
    /// or its ring is too small or ahead of the text); whether it may draft.
    fn ready<S: KvStorage>(&self, a: &mut Active<'_, S>) -> bool {
        let text = a.history.len();
        let ctx = self.model.config().context_length;
        let needed = text + a.draft_want;
        if needed > ctx {
            a.draft_want = 0;
            return false;
        }
        if let Some(kv) = &a.draft_kv
            && (kv.next_pos() as usize > text || kv.capacity() < needed)
        {
            a.draft_kv = None;
        }
        if a.draft_kv.is_none() {
            // Room for the rest of the request and a full draft, within the draft's context.
            let left = a.req.max_new_tokens.saturating_sub(a.output_tokens);
            let cap = (text + left + self.max_draft + 1).min(ctx).max(needed);
            match self.pool.alloc(cap, RingMode::Strict) {
                Ok(kv) => a.draft_kv = Some(kv),
                Err(e) => {
                    tracing::debug!("no draft ring for {} tokens: {e}", cap);
                    a.draft_want = 0;
                    return false;
                }
            }
        }
        true
    }

    /// A failed catch-up: the sequences' rings are dropped (fed again from the start next
    /// time) and they decode this step without drafts.
    fn fail<S: KvStorage>(&self, want: &mut [&mut Active<'_, S>], e: &dyn std::fmt::Display) {
        tracing::warn!("draft model: {e}; decoding without drafts this step");
        for a in want {
            a.draft_kv = None;
            a.draft_want = 0;
        }
    }
}
