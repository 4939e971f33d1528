//! The batch scheduler's decisions, without I/O (sans-IO): which waiting requests are refused or
//! admitted, and what the next batched forward step computes.
//!
//! The engine thread drives it: [`Scheduler::submit`] at request time (admission control),
//! [`Scheduler::admit`] with the KV memory free right now, [`Scheduler::next_batch`] to get the
//! step plan, [`Scheduler::complete_batch`] once the step ran, [`Scheduler::finish`] /
//! [`Scheduler::cancel`] when a sequence stops. Everything is deterministic in its inputs.
//!
//! Policy:
//! - The queue is bounded twice: at most `max_queue` requests and at most `max_queued_tokens` KV
//!   tokens (prompt + `max_new_tokens`) waiting. Beyond that, `submit` refuses at once.
//! - Admission is in (priority descending, arrival) order and stops at the first request whose
//!   KV does not fit (no overtaking, so a big request cannot starve), or at `max_running`.
//! - Every step decodes **all** sequences that are past their prompt (continuous batching: a
//!   running stream gets one token per step, whatever is prefilling); the rest of the step's
//!   token budget goes to prompt chunks of at most `prefill_chunk` tokens, oldest admission
//!   first. `step_token_budget > max_running` guarantees at least one prompt token per step, so
//!   prefill never starves either.

use std::collections::{BTreeMap, HashMap};

/// Identifies a request inside one engine.
pub type SeqId = u64;

/// Limits of a [`Scheduler`].
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most requests waiting for admission.
    pub max_queue: usize,
    /// Most KV tokens (prompt + `max_new_tokens` of each) waiting for admission.
    pub max_queued_tokens: usize,
    /// Most sequences in the running batch.
    pub max_running: usize,
    /// Most tokens (decode tokens + prompt chunk tokens) in one forward step. Must exceed
    /// `max_running`.
    pub step_token_budget: usize,
    /// Most prompt tokens of one sequence in one step.
    pub prefill_chunk: usize,
    /// KV capacity of the whole pool in tokens; a request needing more is refused as too large.
    pub kv_budget_tokens: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_queue: 512,
            max_queued_tokens: 1 << 20,
            max_running: 256,
            step_token_budget: 512,
            prefill_chunk: 256,
            kv_budget_tokens: 1 << 20,
        }
    }
}

/// What the scheduler needs to know about a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSpec {
    /// Prompt length in tokens (at least 1).
    pub prompt_tokens: usize,
    /// Most tokens to generate (at least 1).
    pub max_new_tokens: usize,
    /// Higher is admitted first.
    pub priority: i32,
}

impl SeqSpec {
    /// KV tokens the request needs: prompt plus all generated tokens.
    pub fn kv_tokens(&self) -> usize {
        self.prompt_tokens.saturating_add(self.max_new_tokens)
    }
}

/// Why [`Scheduler::submit`] refused a request.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The waiting queue holds `limit` requests already.
    #[error("queue full: {depth} requests waiting (limit {limit})")]
    QueueFull {
        /// Requests waiting.
        depth: usize,
        /// The limit.
        limit: usize,
    },
    /// The waiting requests' KV demand would exceed the limit.
    #[error("queued KV demand full: {queued} + {requested} tokens > {limit}")]
    QueuedTokensFull {
        /// KV tokens already waiting.
        queued: usize,
        /// KV tokens of this request.
        requested: usize,
        /// The limit.
        limit: usize,
    },
    /// The request alone needs more KV than the whole pool holds.
    #[error("request needs {requested} KV tokens, the pool holds {budget}")]
    TooLarge {
        /// KV tokens of this request.
        requested: usize,
        /// The pool's capacity in tokens.
        budget: usize,
    },
    /// Empty prompt or `max_new_tokens == 0`.
    #[error("empty request: {prompt_tokens} prompt tokens, {max_new_tokens} new tokens")]
    Empty {
        /// Prompt length.
        prompt_tokens: usize,
        /// Tokens to generate.
        max_new_tokens: usize,
    },
    /// The id is already queued or running.
    #[error("sequence id {0} is already in use")]
    DuplicateId(SeqId),
}

/// One sequence's part of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkItem {
    /// Prompt tokens `start..start + len`; `last` when this chunk ends the prompt (the step
    /// then samples the first generated token).
    Prefill {
        /// The sequence.
        id: SeqId,
        /// First prompt token of the chunk.
        start: usize,
        /// Chunk length.
        len: usize,
        /// Whether the chunk ends the prompt.
        last: bool,
    },
    /// One decode token (the last sampled one).
    Decode {
        /// The sequence.
        id: SeqId,
    },
}

impl WorkItem {
    /// The sequence of this item.
    pub fn id(&self) -> SeqId {
        match *self {
            Self::Prefill { id, .. } | Self::Decode { id } => id,
        }
    }
    /// Tokens this item feeds to the model.
    pub fn tokens(&self) -> usize {
        match *self {
            Self::Prefill { len, .. } => len,
            Self::Decode { .. } => 1,
        }
    }
    /// Whether the step samples a token for this item.
    pub fn samples(&self) -> bool {
        match *self {
            Self::Prefill { last, .. } => last,
            Self::Decode { .. } => true,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Waiting {
    spec: SeqSpec,
    key: (i64, u64),
}

#[derive(Clone, Copy, Debug)]
struct Running {
    id: SeqId,
    spec: SeqSpec,
    prefilled: usize,
    generated: usize,
}

/// The scheduler state. See the module docs for the policy.
///
/// ```
/// use gpu_pipeline::engine::{Scheduler, SchedulerConfig, SeqSpec, WorkItem};
/// let mut s = Scheduler::new(SchedulerConfig::default());
/// s.submit(7, SeqSpec { prompt_tokens: 10, max_new_tokens: 2, priority: 0 }).unwrap();
/// assert_eq!(s.admit(1000), vec![7]);
/// s.started(7, 0);
/// assert_eq!(s.next_batch(), vec![WorkItem::Prefill { id: 7, start: 0, len: 10, last: true }]);
/// assert!(s.complete_batch().is_empty());
/// assert_eq!(s.next_batch(), vec![WorkItem::Decode { id: 7 }]);
/// assert_eq!(s.complete_batch(), vec![7]); // max_new_tokens reached
/// ```
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    order: BTreeMap<(i64, u64), SeqId>,
    waiting: HashMap<SeqId, Waiting>,
    queued_tokens: usize,
    running: Vec<Running>,
    arrivals: u64,
    last_batch: Vec<WorkItem>,
}

impl Scheduler {
    /// An empty scheduler. `step_token_budget` is raised to `max_running + 1` and
    /// `prefill_chunk` to 1 if lower.
    pub fn new(mut cfg: SchedulerConfig) -> Self {
        cfg.step_token_budget = cfg.step_token_budget.max(cfg.max_running + 1);
        cfg.prefill_chunk = cfg.prefill_chunk.max(1);
        Self {
            cfg,
            order: BTreeMap::new(),
            waiting: HashMap::new(),
            queued_tokens: 0,
            running: Vec::new(),
            arrivals: 0,
            last_batch: Vec::new(),
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Requests waiting for admission.
    pub fn queue_depth(&self) -> usize {
        self.waiting.len()
    }

    /// KV tokens the waiting requests need.
    pub fn queued_tokens(&self) -> usize {
        self.queued_tokens
    }

    /// Sequences admitted and not finished.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Whether there is nothing to do.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// KV tokens of the request that is next in line for admission.
    pub fn next_waiting_tokens(&self) -> Option<usize> {
        let (_, id) = self.order.iter().next()?;
        Some(self.waiting[id].spec.kv_tokens())
    }

    /// Generated tokens so far of a running sequence.
    pub fn generated(&self, id: SeqId) -> Option<usize> {
        self.running
            .iter()
            .find(|r| r.id == id)
            .map(|r| r.generated)
    }

    /// Admission control: queues the request or refuses it at once.
    pub fn submit(&mut self, id: SeqId, spec: SeqSpec) -> Result<(), Refusal> {
        if spec.prompt_tokens == 0 || spec.max_new_tokens == 0 {
            return Err(Refusal::Empty {
                prompt_tokens: spec.prompt_tokens,
                max_new_tokens: spec.max_new_tokens,
            });
        }
        if self.waiting.contains_key(&id) || self.running.iter().any(|r| r.id == id) {
            return Err(Refusal::DuplicateId(id));
        }
        let need = spec.kv_tokens();
        if need > self.cfg.kv_budget_tokens {
            return Err(Refusal::TooLarge {
                requested: need,
                budget: self.cfg.kv_budget_tokens,
            });
        }
        if self.waiting.len() >= self.cfg.max_queue {
            return Err(Refusal::QueueFull {
                depth: self.waiting.len(),
                limit: self.cfg.max_queue,
            });
        }
        if self.queued_tokens + need > self.cfg.max_queued_tokens {
            return Err(Refusal::QueuedTokensFull {
                queued: self.queued_tokens,
                requested: need,
                limit: self.cfg.max_queued_tokens,
            });
        }
        let key = (-i64::from(spec.priority), self.arrivals);
        self.arrivals += 1;
        self.order.insert(key, id);
        self.waiting.insert(id, Waiting { spec, key });
        self.queued_tokens += need;
        Ok(())
    }

    /// Admits waiting requests in order while their KV fits in `kv_free_tokens` and the batch
    /// has room. The caller must then call [`started`](Self::started) or
    /// [`start_failed`](Self::start_failed) for each returned id.
    pub fn admit(&mut self, kv_free_tokens: usize) -> Vec<SeqId> {
        let mut free = kv_free_tokens;
        let mut out = Vec::new();
        while self.running.len() + out.len() < self.cfg.max_running {
            let Some((&key, &id)) = self.order.iter().next() else {
                break;
            };
            let need = self.waiting[&id].spec.kv_tokens();
            if need > free {
                break;
            }
            free -= need;
            self.order.remove(&key);
            out.push(id);
        }
        out
    }

    /// An admitted sequence got its KV; `cached_prompt_tokens` of its prompt are already in it
    /// (prefix reuse; at most `prompt_tokens - 1`).
    pub fn started(&mut self, id: SeqId, cached_prompt_tokens: usize) {
        if let Some(w) = self.waiting.remove(&id) {
            self.queued_tokens -= w.spec.kv_tokens();
            let prefilled = cached_prompt_tokens.min(w.spec.prompt_tokens - 1);
            self.running.push(Running {
                id,
                spec: w.spec,
                prefilled,
                generated: 0,
            });
        }
    }

    /// An admitted sequence could not get its KV: it goes back to its place in the queue.
    pub fn start_failed(&mut self, id: SeqId) {
        if let Some(w) = self.waiting.get(&id) {
            self.order.insert(w.key, id);
        }
    }

    /// The next step: every decoding sequence, then prompt chunks within the token budget.
    /// Remembered until [`complete_batch`](Self::complete_batch).
    pub fn next_batch(&mut self) -> Vec<WorkItem> {
        let mut items = Vec::with_capacity(self.running.len());
        for r in &self.running {
            if r.prefilled == r.spec.prompt_tokens {
                items.push(WorkItem::Decode { id: r.id });
            }
        }
        let mut budget = self.cfg.step_token_budget.saturating_sub(items.len());
        for r in &self.running {
            if budget == 0 {
                break;
            }
            let left = r.spec.prompt_tokens - r.prefilled;
            if left == 0 {
                continue;
            }
            let len = left.min(self.cfg.prefill_chunk).min(budget);
            budget -= len;
            items.push(WorkItem::Prefill {
                id: r.id,
                start: r.prefilled,
                len,
                last: len == left,
            });
        }
        self.last_batch.clone_from(&items);
        items
    }

    /// The step planned by [`next_batch`](Self::next_batch) ran: advances the sequences and
    /// returns those that reached `max_new_tokens` (removed from the batch). Items of
    /// sequences cancelled or finished in between are ignored.
    pub fn complete_batch(&mut self) -> Vec<SeqId> {
        let mut done = Vec::new();
        for item in std::mem::take(&mut self.last_batch) {
            let Some(r) = self.running.iter_mut().find(|r| r.id == item.id()) else {
                continue;
            };
            if let WorkItem::Prefill { len, .. } = item {
                r.prefilled += len;
            }
            if item.samples() {
                r.generated += 1;
                if r.generated >= r.spec.max_new_tokens {
                    done.push(r.id);
                }
            }
        }
        self.running.retain(|r| !done.contains(&r.id));
        done
    }

    /// A running sequence stopped early (end token, stop sequence, error): removes it.
    pub fn finish(&mut self, id: SeqId) -> bool {
        let before = self.running.len();
        self.running.retain(|r| r.id != id);
        before != self.running.len()
    }

    /// Removes a request wherever it is (queue or batch). Returns whether it was known.
    pub fn cancel(&mut self, id: SeqId) -> bool {
        if let Some(w) = self.waiting.remove(&id) {
            self.order.remove(&w.key);
            self.queued_tokens -= w.spec.kv_tokens();
            return true;
        }
        self.finish(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spec(p: usize, n: usize) -> SeqSpec {
        SeqSpec {
            prompt_tokens: p,
            max_new_tokens: n,
            priority: 0,
        }
    }

    fn cfg() -> SchedulerConfig {
        SchedulerConfig {
            max_queue: 4,
            max_queued_tokens: 100,
            max_running: 3,
            step_token_budget: 8,
            prefill_chunk: 4,
            kv_budget_tokens: 60,
        }
    }

    #[test]
    fn refusals_are_typed() {
        let mut s = Scheduler::new(cfg());
        assert_eq!(
            s.submit(1, spec(0, 1)),
            Err(Refusal::Empty {
                prompt_tokens: 0,
                max_new_tokens: 1
            })
        );
        assert_eq!(
            s.submit(1, spec(50, 20)),
            Err(Refusal::TooLarge {
                requested: 70,
                budget: 60
            })
        );
        s.submit(1, spec(10, 40)).unwrap();
        assert_eq!(s.submit(1, spec(1, 1)), Err(Refusal::DuplicateId(1)));
        assert_eq!(
            s.submit(2, spec(30, 30)),
            Err(Refusal::QueuedTokensFull {
                queued: 50,
                requested: 60,
                limit: 100
            })
        );
        for id in 2..5 {
            s.submit(id, spec(1, 1)).unwrap();
        }
        assert_eq!(
            s.submit(9, spec(1, 1)),
            Err(Refusal::QueueFull { depth: 4, limit: 4 })
        );
        assert!(s.cancel(1));
        s.submit(9, spec(1, 1)).unwrap();
    }

    #[test]
    fn priority_then_fifo_and_no_overtaking() {
        let mut s = Scheduler::new(cfg());
        s.submit(1, spec(5, 5)).unwrap();
        s.submit(
            2,
            SeqSpec {
                priority: 5,
                ..spec(5, 5)
            },
        )
        .unwrap();
        s.submit(3, spec(40, 10)).unwrap();
        s.submit(4, spec(1, 1)).unwrap();
        // 2 first (priority), then 1; 3 needs 50 and does not fit in 30, so 4 waits behind it.
        assert_eq!(s.admit(30), vec![2, 1]);
        s.started(2, 0);
        s.started(1, 0);
        assert_eq!(s.admit(10), Vec::<SeqId>::new());
        assert_eq!(s.admit(60), vec![3]);
        s.start_failed(3);
        assert_eq!(s.admit(60), vec![3]);
    }

    #[test]
    fn chunked_prefill_interleaves_with_decode() {
        let mut s = Scheduler::new(cfg());
        s.submit(1, spec(2, 10)).unwrap();
        s.submit(2, spec(11, 2)).unwrap();
        assert_eq!(s.admit(100), vec![1, 2]);
        s.started(1, 0);
        s.started(2, 5);
        let b = s.next_batch();
        assert_eq!(
            b,
            vec![
                WorkItem::Prefill {
                    id: 1,
                    start: 0,
                    len: 2,
                    last: true
                },
                WorkItem::Prefill {
                    id: 2,
                    start: 5,
                    len: 4,
                    last: false
                }
            ]
        );
        s.complete_batch();
        assert_eq!(
            s.next_batch(),
            vec![
                WorkItem::Decode { id: 1 },
                WorkItem::Prefill {
                    id: 2,
                    start: 9,
                    len: 2,
                    last: true
                }
            ]
        );
        assert!(s.complete_batch().is_empty());
        assert_eq!(
            s.next_batch(),
            vec![WorkItem::Decode { id: 1 }, WorkItem::Decode { id: 2 }]
        );
        assert_eq!(s.complete_batch(), vec![2]);
        assert_eq!(s.running(), 1);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Submit(usize, usize, i32),
        Cancel(u64),
        Step(usize),
        Stop(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (1usize..30, 1usize..12, -1i32..2).prop_map(|(p, n, pr)| Op::Submit(p, n, pr)),
            1 => (0u64..40).prop_map(Op::Cancel),
            5 => (0usize..120).prop_map(Op::Step),
            1 => (0u64..40).prop_map(Op::Stop),
        ]
    }

    /// Model-based simulation: the shell's KV pool is a token counter.
    fn simulate(ops: &[Op], cfg: SchedulerConfig) -> Result<(), TestCaseError> {
        let mut s = Scheduler::new(cfg.clone());
        let mut kv_used: HashMap<SeqId, usize> = HashMap::new();
        let mut prompt_left: HashMap<SeqId, usize> = HashMap::new();
        let mut next = 0u64;
        let mut accepted = Vec::new();
        for o in ops {
            match *o {
                Op::Submit(p, n, pr) => {
                    let r = s.submit(
                        next,
                        SeqSpec {
                            prompt_tokens: p,
                            max_new_tokens: n,
                            priority: pr,
                        },
                    );
                    if r.is_ok() {
                        accepted.push(next);
                    }
                    next += 1;
                }
                Op::Cancel(id) | Op::Stop(id) => {
                    let known = if matches!(o, Op::Cancel(_)) {
                        s.cancel(id)
                    } else {
                        s.finish(id)
                    };
                    if known {
                        kv_used.remove(&id);
                    }
                }
                Op::Step(extra_kv_pressure) => {
                    let used: usize = kv_used.values().sum();
                    let free = cfg
                        .kv_budget_tokens
                        .saturating_sub(used + extra_kv_pressure);
                    let adm = s.admit(free);
                    let need: usize = adm.iter().map(|id| s.waiting[id].spec.kv_tokens()).sum();
                    prop_assert!(need <= free, "admitted beyond the KV free");
                    for id in adm {
                        let w = s.waiting[&id].spec;
                        kv_used.insert(id, w.kv_tokens());
                        prompt_left.insert(id, w.prompt_tokens);
                        s.started(id, 0);
                    }
                    let decoding: Vec<SeqId> = s
                        .running
                        .iter()
                        .filter(|r| r.prefilled == r.spec.prompt_tokens)
                        .map(|r| r.id)
                        .collect();
                    let prefilling = s.running.len() - decoding.len();
                    let b = s.next_batch();
                    let total: usize = b.iter().map(WorkItem::tokens).sum();
                    prop_assert!(total <= s.cfg.step_token_budget);
                    for id in &decoding {
                        prop_assert!(
                            b.contains(&WorkItem::Decode { id: *id }),
                            "a decoding stream was skipped"
                        );
                    }
                    if prefilling > 0 {
                        prop_assert!(
                            b.iter().any(|i| matches!(i, WorkItem::Prefill { .. })),
                            "prefill starved"
                        );
                    }
                    for i in &b {
                        if let WorkItem::Prefill { id, len, last, .. } = *i {
                            prop_assert!(len <= s.cfg.prefill_chunk);
                            let left = prompt_left.get_mut(&id).unwrap();
                            *left -= len;
                            prop_assert_eq!(last, *left == 0);
                        }
                    }
                    for id in s.complete_batch() {
                        kv_used.remove(&id);
                    }
                }
            }
            prop_assert!(s.queue_depth() <= cfg.max_queue);
            prop_assert!(s.queued_tokens() <= cfg.max_queued_tokens);
            prop_assert!(s.running() <= cfg.max_running);
            prop_assert!(kv_used.values().sum::<usize>() <= cfg.kv_budget_tokens);
        }
        // Drain: with no new arrivals, everything finishes (no starvation).
        let mut steps = 0;
        while !s.is_idle() {
            let used: usize = kv_used.values().sum();
            for id in s.admit(cfg.kv_budget_tokens - used) {
                kv_used.insert(id, s.waiting[&id].spec.kv_tokens());
                s.started(id, 0);
            }
            s.next_batch();
            for id in s.complete_batch() {
                kv_used.remove(&id);
            }
            steps += 1;
            prop_assert!(steps < 10_000, "did not drain");
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn policy_invariants(ops in proptest::collection::vec(op(), 1..200),
                             max_running in 1usize..6, budget in 1usize..12, chunk in 1usize..8) {
            let cfg = SchedulerConfig {
                max_queue: 6,
                max_queued_tokens: 120,
                max_running,
                step_token_budget: budget,
                prefill_chunk: chunk,
                kv_budget_tokens: 80,
            };
            simulate(&ops, cfg)?;
        }
    }
}
