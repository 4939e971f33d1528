//! The batch scheduler's decisions, without I/O (sans-IO): which waiting requests are refused or
//! admitted, how much KV each running sequence holds, which sequence gives its KV back when the
//! pool runs out, and what the next batched forward step computes.
//!
//! The engine thread drives it: [`Scheduler::submit`] at request time (admission control),
//! [`Scheduler::schedule`] with the KV memory free right now (returns a [`KvPlan`]: sequences
//! to preempt, rings to grow, requests to admit, applied by the engine in that order),
//! [`Scheduler::started`] / [`Scheduler::start_failed`] for each admitted request,
//! [`Scheduler::next_batch`] to get the step plan, [`Scheduler::complete_batch`] once the step
//! ran, [`Scheduler::finish`] / [`Scheduler::cancel`] when a sequence stops. Everything is
//! deterministic in its inputs.
//!
//! Policy:
//! - **KV by use, not by promise.** A request is admitted with a reservation of its prompt plus
//!   one growth chunk (`kv_grow_chunk` tokens, at most prompt + `max_new_tokens`), not its whole
//!   `max_new_tokens`: a client asking for 8000 tokens holds what it has generated, rounded up
//!   to a chunk. Before a step, a decoding sequence that reached its reservation grows by one
//!   chunk (once per chunk, never per token). Prefill never grows: the prompt is reserved.
//! - **Preemption (recompute).** When growth does not fit in the free KV, victims give their KV
//!   back until it fits: a victim goes back to the queue, at its old place, with prompt +
//!   generated-so-far as its new prompt and the rest of its `max_new_tokens`; the engine
//!   recomputes its KV when it is readmitted, so the client sees only latency. Victim order: the
//!   sequence of the client holding the most KV over its fair share (pool / clients with work),
//!   then the lowest priority, then the youngest admission. A sequence alone always fits (a
//!   request larger than the pool is refused at submit), so growth never waits on anything:
//!   running sequences are never stalled, only preempted.
//! - **Clients.** Each request carries a [`ClientKey`] (the engine maps the API key's label to
//!   it; requests without one share one anonymous key). A client may have at most
//!   `max_running_per_client` requests in the engine (queued + running), beyond which `submit`
//!   refuses with [`Refusal::ClientLimit`]. While other clients wait, a client already running
//!   something is not admitted past `max_kv_share_per_client` of the pool (its first sequence
//!   always is, so the cap cannot leave everybody waiting).
//! - **Fair admission.** Waiting requests are admitted by priority (higher first); within a
//!   priority, round-robin over clients: the client served least recently goes first (ties: the
//!   older head request), each client's requests in arrival order. Guarantee: a request at the
//!   head of its client's queue, at the highest waiting priority, is admitted after at most one
//!   admission per other client waiting at that priority, provided its KV fits; a burst of 100
//!   requests from one client delays another client's request by one admission, not 100.
//! - **Room for the under-served.** When the request chosen next does not fit, it may preempt
//!   sequences of clients over their fair share, if its own client stays within its fair share.
//!   So KV only moves from clients over their share to clients under it, never back, and a
//!   hoard cannot keep others out. Otherwise admission stops there (no overtaking by size, so a
//!   big request cannot starve behind small ones).
//! - **Bounded queue.** At most `max_queue` requests and `max_queued_tokens` KV tokens
//!   (prompt plus `max_new_tokens`) wait, or `submit` refuses at once. Preempted sequences
//!   re-enter the queue without these checks (they were accepted already): the queue may
//!   exceed `max_queue` by at most `max_running`.
//! - **Steps.** Every step decodes **all** sequences that are past their prompt (continuous
//!   batching); the rest of the step's token budget goes to prompt chunks of at most
//!   `prefill_chunk` tokens, oldest admission first. `step_token_budget > max_running`
//!   guarantees at least one prompt token per step, so prefill never starves either.
//! - **Speculative drafts take what is left.** A decoding sequence may ask for draft tokens
//!   ([`Scheduler::set_draft`]: speculative decoding verifies them in its step). They get the
//!   step's token budget left after the decode tokens and the prompt chunks, and KV room within
//!   the sequence's reservation; a reservation grows for drafts only from KV that is free after
//!   the admissions, never by preempting anyone. So drafts change nothing above: they only
//!   make a step emit up to `1 + draft` tokens ([`Scheduler::drafts_accepted`]), and the KV a
//!   step writes never exceeds the reservation (rejected drafts are rolled back by the
//!   engine).
//!
//! Why nothing deadlocks, livelocks or starves:
//! - The KV planned never exceeds what the engine reports free: growth and admissions are
//!   planned within it, after the preemptions that free it.
//! - Any one request fits the pool (larger ones are refused at submit) and a client holding
//!   nothing is never held back by the share cap, so when nothing runs the next request in
//!   fair order is admitted, and a sequence alone can always grow to its end.
//! - A preempted sequence keeps its generated tokens (they become its prompt): generation
//!   progress is never lost, only recomputed. Growth, and so growth preemption, happens only
//!   in steps that generate a token. Between two such steps, an admission preempts only
//!   sequences of clients over their fair share, for a client that stays within it, so the
//!   total KV held over the fair shares strictly decreases with each such preemption (no
//!   ping-pong); everything else in those steps is prefill progress.
//! - Hence with no new arrivals every request finishes within a bounded number of steps, and
//!   with arrivals a waiting request is passed only by higher priorities and by at most one
//!   admission per other client (the round-robin above). The property test in this file checks
//!   the KV bound, one end per request and the drain bound against a reference shell.

use std::collections::{BTreeMap, HashMap};

/// Identifies a request inside one engine.
pub type SeqId = u64;

/// Identifies a client (an API key's label) inside one engine; the engine maps labels to keys.
pub type ClientKey = u64;

/// Limits of a [`Scheduler`].
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq)]
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
    /// KV tokens reserved beyond the prompt at admission, and added at each growth.
    pub kv_grow_chunk: usize,
    /// Most requests (queued + running) of one client.
    pub max_running_per_client: usize,
    /// Largest fraction of `kv_budget_tokens` one client is admitted up to while other clients
    /// wait (1.0: no cap beyond the fair-share preemption; clamped to [0, 1], NaN means 1).
    pub max_kv_share_per_client: f64,
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
            kv_grow_chunk: 256,
            max_running_per_client: usize::MAX,
            max_kv_share_per_client: 1.0,
        }
    }
}

impl SchedulerConfig {
    /// Sets [`max_queue`](Self::max_queue).
    pub fn with_max_queue(mut self, n: usize) -> Self {
        self.max_queue = n;
        self
    }
    /// Sets [`max_queued_tokens`](Self::max_queued_tokens).
    pub fn with_max_queued_tokens(mut self, n: usize) -> Self {
        self.max_queued_tokens = n;
        self
    }
    /// Sets [`max_running`](Self::max_running).
    pub fn with_max_running(mut self, n: usize) -> Self {
        self.max_running = n;
        self
    }
    /// Sets [`step_token_budget`](Self::step_token_budget).
    pub fn with_step_token_budget(mut self, n: usize) -> Self {
        self.step_token_budget = n;
        self
    }
    /// Sets [`prefill_chunk`](Self::prefill_chunk).
    pub fn with_prefill_chunk(mut self, n: usize) -> Self {
        self.prefill_chunk = n;
        self
    }
    /// Sets [`kv_budget_tokens`](Self::kv_budget_tokens).
    pub fn with_kv_budget_tokens(mut self, n: usize) -> Self {
        self.kv_budget_tokens = n;
        self
    }
    /// Sets [`kv_grow_chunk`](Self::kv_grow_chunk).
    pub fn with_kv_grow_chunk(mut self, n: usize) -> Self {
        self.kv_grow_chunk = n;
        self
    }
    /// Sets [`max_running_per_client`](Self::max_running_per_client).
    pub fn with_max_running_per_client(mut self, n: usize) -> Self {
        self.max_running_per_client = n;
        self
    }
    /// Sets [`max_kv_share_per_client`](Self::max_kv_share_per_client).
    pub fn with_max_kv_share_per_client(mut self, share: f64) -> Self {
        self.max_kv_share_per_client = share;
        self
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
    /// Who sent it.
    pub client: ClientKey,
}

impl SeqSpec {
    /// A request of client 0 at priority 0.
    ///
    /// ```
    /// use gpu_pipeline::engine::SeqSpec;
    /// let s = SeqSpec::new(10, 5).with_client(3).with_priority(1);
    /// assert_eq!((s.kv_tokens(), s.client, s.priority), (15, 3, 1));
    /// ```
    pub fn new(prompt_tokens: usize, max_new_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            max_new_tokens,
            priority: 0,
            client: 0,
        }
    }
    /// Sets [`client`](Self::client).
    pub fn with_client(mut self, client: ClientKey) -> Self {
        self.client = client;
        self
    }
    /// Sets [`priority`](Self::priority).
    pub fn with_priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }
    /// KV tokens the request needs at most: prompt plus all generated tokens.
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
    /// The client has `limit` requests queued or running already.
    #[error("too many requests in flight for this client: {in_flight} (limit {limit})")]
    ClientLimit {
        /// The client's requests queued or running.
        in_flight: usize,
        /// The limit (`max_running_per_client`).
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
    /// One decode token (the last sampled one), followed by `draft` speculative tokens to
    /// verify in the same step (0 without speculation).
    Decode {
        /// The sequence.
        id: SeqId,
        /// Draft tokens granted in this step ([`Scheduler::set_draft`]).
        draft: usize,
    },
}

impl WorkItem {
    /// The sequence of this item.
    pub fn id(&self) -> SeqId {
        match *self {
            Self::Prefill { id, .. } | Self::Decode { id, .. } => id,
        }
    }
    /// Tokens this item feeds to the model.
    pub fn tokens(&self) -> usize {
        match *self {
            Self::Prefill { len, .. } => len,
            Self::Decode { draft, .. } => 1 + draft,
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

/// What [`Scheduler::schedule`] decided, to be applied by the engine in field order.
///
/// ```
/// use gpu_pipeline::engine::{KvPlan, Scheduler, SchedulerConfig, SeqSpec};
/// let mut s = Scheduler::new(SchedulerConfig::default().with_kv_grow_chunk(4));
/// s.submit(1, SeqSpec::new(10, 100)).unwrap();
/// let plan = s.schedule(1000);
/// assert_eq!(plan.admit, vec![(1, 14)]); // prompt + one chunk, not prompt + 100
/// assert!(plan.preempt.is_empty() && plan.grow.is_empty());
/// ```
#[non_exhaustive]
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvPlan {
    /// Running sequences to preempt first: free their KV, and queue them again with prompt +
    /// generated tokens as their prompt (the scheduler already did).
    pub preempt: Vec<SeqId>,
    /// Running sequences whose KV must grow to the given capacity (tokens) before the step.
    pub grow: Vec<(SeqId, usize)>,
    /// Requests admitted, with the KV capacity (tokens) to allocate for each; answer each with
    /// [`Scheduler::started`] or [`Scheduler::start_failed`].
    pub admit: Vec<(SeqId, usize)>,
}

/// Per-client counts ([`Scheduler::client_usage`]).
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientUsage {
    /// Requests queued or running.
    pub in_flight: usize,
    /// Requests waiting for admission.
    pub waiting: usize,
    /// Sequences admitted.
    pub running: usize,
    /// KV tokens reserved by the client's running sequences.
    pub kv_tokens: usize,
    /// Admission turn of the client's last admission (round-robin order).
    last_served: u64,
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
    key: (i64, u64),
    prefilled: usize,
    generated: usize,
    reserved: usize,
    admitted: u64,
    /// Draft tokens the sequence would like to verify in its next steps ([`Scheduler::set_draft`]).
    draft_wanted: usize,
    /// Draft tokens of the last batch's step that were accepted ([`Scheduler::drafts_accepted`]).
    draft_accepted: usize,
}

impl Running {
    /// KV positions the sequence's next step writes up to (prompt + generated tokens fed),
    /// without drafts.
    fn kv_needed_next(&self) -> usize {
        if self.prefilled < self.spec.prompt_tokens {
            self.spec.prompt_tokens
        } else {
            self.spec.prompt_tokens + self.generated
        }
    }

    /// Whether the sequence is past its prompt.
    fn decoding(&self) -> bool {
        self.prefilled == self.spec.prompt_tokens
    }

    /// Draft tokens the next step may verify, before the step budget and the KV room: what
    /// was asked, less than the tokens left to generate, within a chunk.
    fn draft_cap(&self, prefill_chunk: usize) -> usize {
        if !self.decoding() {
            return 0;
        }
        let left = self.spec.max_new_tokens.saturating_sub(self.generated + 1);
        self.draft_wanted
            .min(left)
            .min(prefill_chunk.saturating_sub(1))
    }
}

/// The scheduler state. See the module docs for the policy.
///
/// ```
/// use gpu_pipeline::engine::{Scheduler, SchedulerConfig, SeqSpec, WorkItem};
/// let mut s = Scheduler::new(SchedulerConfig::default());
/// s.submit(7, SeqSpec::new(10, 2)).unwrap();
/// assert_eq!(s.schedule(1000).admit, vec![(7, 12)]);
/// s.started(7, 0);
/// assert_eq!(s.next_batch(), vec![WorkItem::Prefill { id: 7, start: 0, len: 10, last: true }]);
/// assert!(s.complete_batch().is_empty());
/// assert_eq!(s.next_batch(), vec![WorkItem::Decode { id: 7, draft: 0 }]);
/// assert_eq!(s.complete_batch(), vec![7]); // max_new_tokens reached
/// ```
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    order: BTreeMap<(i64, u64), SeqId>,
    waiting: HashMap<SeqId, Waiting>,
    queued_tokens: usize,
    running: Vec<Running>,
    clients: HashMap<ClientKey, ClientUsage>,
    arrivals: u64,
    turns: u64,
    preemptions: u64,
    last_batch: Vec<WorkItem>,
}

impl Scheduler {
    /// An empty scheduler. `step_token_budget` is raised to `max_running + 1`, and
    /// `prefill_chunk`, `kv_grow_chunk` and `max_running_per_client` to 1 if lower.
    pub fn new(mut cfg: SchedulerConfig) -> Self {
        cfg.step_token_budget = cfg.step_token_budget.max(cfg.max_running + 1);
        cfg.prefill_chunk = cfg.prefill_chunk.max(1);
        cfg.kv_grow_chunk = cfg.kv_grow_chunk.max(1);
        cfg.max_running_per_client = cfg.max_running_per_client.max(1);
        Self {
            cfg,
            order: BTreeMap::new(),
            waiting: HashMap::new(),
            queued_tokens: 0,
            running: Vec::new(),
            clients: HashMap::new(),
            arrivals: 0,
            turns: 0,
            preemptions: 0,
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

    /// Preemptions since the start.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// KV tokens reserved by all running sequences.
    pub fn kv_reserved(&self) -> usize {
        self.running.iter().map(|r| r.reserved).sum()
    }

    /// KV tokens reserved by a running sequence.
    pub fn reserved(&self, id: SeqId) -> Option<usize> {
        self.running.iter().find(|r| r.id == id).map(|r| r.reserved)
    }

    /// Whether the request is waiting for admission (also after a preemption).
    pub fn is_waiting(&self, id: SeqId) -> bool {
        self.waiting.contains_key(&id)
    }

    /// A client's counts, if it has requests in flight.
    pub fn client_usage(&self, client: ClientKey) -> Option<ClientUsage> {
        self.clients.get(&client).copied()
    }

    /// KV tokens the next [`schedule`](Self::schedule) would like free beyond what the
    /// running sequences hold: their growth plus the next waiting request's reservation. The
    /// engine frees reclaimable memory (cached prefixes) up to this before scheduling.
    pub fn kv_wanted(&self) -> usize {
        let growth: usize = self
            .running
            .iter()
            .filter_map(|r| self.growth_of(r).map(|(_, to)| to - r.reserved))
            .sum();
        let next = self
            .order
            .values()
            .next()
            .map_or(0, |id| self.reservation(&self.waiting[id].spec));
        growth + next
    }

    /// Generated tokens so far of a running sequence (since its last admission).
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
        let in_flight = self.clients.get(&spec.client).map_or(0, |c| c.in_flight);
        if in_flight >= self.cfg.max_running_per_client {
            return Err(Refusal::ClientLimit {
                in_flight,
                limit: self.cfg.max_running_per_client,
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
        let c = self.clients.entry(spec.client).or_default();
        c.in_flight += 1;
        c.waiting += 1;
        self.enqueue(id, spec, key);
        Ok(())
    }

    fn enqueue(&mut self, id: SeqId, spec: SeqSpec, key: (i64, u64)) {
        self.order.insert(key, id);
        self.waiting.insert(id, Waiting { spec, key });
        self.queued_tokens += spec.kv_tokens();
    }

    /// KV tokens reserved at admission: the prompt plus one growth chunk.
    fn reservation(&self, spec: &SeqSpec) -> usize {
        spec.prompt_tokens
            .saturating_add(self.cfg.kv_grow_chunk)
            .min(spec.kv_tokens())
    }

    /// The capacity a running sequence must grow to before its next step, if any.
    fn growth_of(&self, r: &Running) -> Option<(SeqId, usize)> {
        let need = r.kv_needed_next();
        (need > r.reserved).then(|| {
            let to = r
                .reserved
                .saturating_add(self.cfg.kv_grow_chunk)
                .max(need)
                .min(r.spec.kv_tokens());
            (r.id, to)
        })
    }

    /// The fair share of the pool per client: the budget over the clients with work.
    fn fair_share(&self) -> usize {
        self.cfg.kv_budget_tokens / self.clients.len().max(1)
    }

    /// How far over its fair share a client is (negative: under).
    fn over_share(&self, client: ClientKey) -> i64 {
        let held = self.clients.get(&client).map_or(0, |c| c.kv_tokens);
        held as i64 - self.fair_share() as i64
    }

    /// Index in `running` of the next victim: the sequence of the client most over its fair
    /// share, then the lowest priority, then the youngest admission. `only_over`: only clients
    /// strictly over their share (and not `spare`).
    fn victim(&self, only_over: bool, spare: Option<ClientKey>) -> Option<usize> {
        self.running
            .iter()
            .enumerate()
            .filter(|(_, r)| {
                !only_over || (self.over_share(r.spec.client) > 0 && Some(r.spec.client) != spare)
            })
            .max_by_key(|(_, r)| {
                (
                    self.over_share(r.spec.client),
                    -i64::from(r.spec.priority),
                    r.admitted,
                )
            })
            .map(|(i, _)| i)
    }

    /// Moves running sequence `i` back to the queue, its generated tokens appended to its
    /// prompt. Returns its id and the KV tokens it gave back.
    fn preempt_at(&mut self, i: usize) -> (SeqId, usize) {
        let r = self.running.remove(i);
        let c = self.clients.entry(r.spec.client).or_default();
        c.running -= 1;
        c.waiting += 1;
        c.kv_tokens -= r.reserved;
        let spec = SeqSpec {
            prompt_tokens: r.spec.prompt_tokens + r.generated,
            max_new_tokens: r.spec.max_new_tokens - r.generated,
            ..r.spec
        };
        self.enqueue(r.id, spec, r.key);
        self.preemptions += 1;
        (r.id, r.reserved)
    }

    /// The waiting request to admit next: the highest priority with an eligible client, and
    /// among those the client served least recently (ties: older head request).
    fn candidate(&self, skip: &[SeqId]) -> Option<SeqId> {
        let share = self.cfg.max_kv_share_per_client;
        let share = if share.is_nan() {
            1.0
        } else {
            share.clamp(0.0, 1.0)
        };
        let share_cap = (share * self.cfg.kv_budget_tokens as f64) as usize;
        let mut seen: Vec<ClientKey> = Vec::new();
        let mut best: Option<(i64, (u64, u64), SeqId)> = None;
        for (&(prio, arrival), &id) in &self.order {
            if best.is_some_and(|b| b.0 != prio) {
                break;
            }
            let w = &self.waiting[&id];
            let client = w.spec.client;
            if seen.contains(&client) {
                continue;
            }
            seen.push(client);
            if skip.contains(&id) {
                continue;
            }
            let c = self.clients.get(&client).copied().unwrap_or_default();
            let others_wait = self.waiting.len() > c.waiting;
            // A client holding nothing is always eligible: every client can run one sequence,
            // so the cap cannot keep everyone waiting.
            if others_wait && c.kv_tokens > 0 && c.kv_tokens + self.reservation(&w.spec) > share_cap
            {
                continue;
            }
            let rank = (c.last_served, arrival);
            if best.is_none_or(|b| rank < b.1) {
                best = Some((prio, rank, id));
            }
        }
        best.map(|b| b.2)
    }

    /// Plans the KV for the next step within `kv_free_tokens` (the pool's free KV now): the
    /// growth running sequences need (preempting victims when it does not fit), then
    /// admissions in fair order (preempting sequences of clients over their fair share for a
    /// client under it). See the module docs.
    pub fn schedule(&mut self, kv_free_tokens: usize) -> KvPlan {
        let mut plan = KvPlan::default();
        let mut skip = Vec::new();
        let mut free = kv_free_tokens;
        // 1. Growth, with preemption when it does not fit.
        loop {
            let growth: Vec<(SeqId, usize)> = self
                .running
                .iter()
                .filter_map(|r| self.growth_of(r))
                .collect();
            let delta: usize = growth
                .iter()
                .map(|&(id, to)| to - self.reserved(id).unwrap_or(to))
                .sum();
            if delta <= free {
                for &(id, to) in &growth {
                    let r = self
                        .running
                        .iter_mut()
                        .find(|r| r.id == id)
                        .expect("growth of a running sequence");
                    let c = self.clients.entry(r.spec.client).or_default();
                    c.kv_tokens += to - r.reserved;
                    r.reserved = to;
                }
                free -= delta;
                plan.grow = growth;
                break;
            }
            let Some(i) = self.victim(false, None) else {
                break;
            };
            let (id, freed) = self.preempt_at(i);
            free += freed;
            plan.preempt.push(id);
            skip.push(id);
        }
        // 2. Admission in fair order.
        while self.running.len() < self.cfg.max_running {
            let Some(id) = self.candidate(&skip) else {
                break;
            };
            let spec = self.waiting[&id].spec;
            let need = self.reservation(&spec);
            if need > free && !self.make_room(&spec, need, &mut free, &mut plan, &mut skip) {
                break;
            }
            free -= need;
            self.admit_now(id, need);
            plan.admit.push((id, need));
        }
        // 3. Room for drafts, from what is still free (never by preemption).
        for i in 0..self.running.len() {
            let r = &self.running[i];
            let need = r.kv_needed_next() + r.draft_cap(self.cfg.prefill_chunk);
            if need <= r.reserved || plan.admit.iter().any(|a| a.0 == r.id) {
                continue;
            }
            let to = r
                .reserved
                .saturating_add(self.cfg.kv_grow_chunk)
                .max(need)
                .min(r.spec.kv_tokens());
            let delta = to - r.reserved;
            if delta > free {
                continue;
            }
            free -= delta;
            let r = &mut self.running[i];
            r.reserved = to;
            let (id, client) = (r.id, r.spec.client);
            self.clients.entry(client).or_default().kv_tokens += delta;
            match plan.grow.iter_mut().find(|g| g.0 == id) {
                Some(g) => g.1 = to,
                None => plan.grow.push((id, to)),
            }
        }
        plan
    }

    /// Preempts sequences of clients over their fair share until `need` fits, if the
    /// candidate's client stays within its fair share and enough could be freed.
    fn make_room(
        &mut self,
        spec: &SeqSpec,
        need: usize,
        free: &mut usize,
        plan: &mut KvPlan,
        skip: &mut Vec<SeqId>,
    ) -> bool {
        let held = self.clients.get(&spec.client).map_or(0, |c| c.kv_tokens);
        if held + need > self.fair_share() {
            return false;
        }
        let reclaimable: usize = self
            .running
            .iter()
            .filter(|r| r.spec.client != spec.client && self.over_share(r.spec.client) > 0)
            .map(|r| r.reserved)
            .sum();
        if *free + reclaimable < need {
            return false;
        }
        while *free < need {
            let Some(i) = self.victim(true, Some(spec.client)) else {
                return false;
            };
            let (id, freed) = self.preempt_at(i);
            *free += freed;
            skip.push(id);
            // Admitted in this plan: the shell never started it, so it is simply not admitted.
            if let Some(k) = plan.admit.iter().position(|a| a.0 == id) {
                plan.admit.remove(k);
                self.preemptions -= 1;
            } else {
                plan.grow.retain(|g| g.0 != id);
                plan.preempt.push(id);
            }
        }
        true
    }

    fn admit_now(&mut self, id: SeqId, reserved: usize) {
        let Some(w) = self.waiting.remove(&id) else {
            return;
        };
        self.order.remove(&w.key);
        self.queued_tokens -= w.spec.kv_tokens();
        self.turns += 1;
        let c = self.clients.entry(w.spec.client).or_default();
        c.waiting -= 1;
        c.running += 1;
        c.kv_tokens += reserved;
        c.last_served = self.turns;
        self.running.push(Running {
            id,
            spec: w.spec,
            key: w.key,
            prefilled: 0,
            generated: 0,
            reserved,
            admitted: self.turns,
            draft_wanted: 0,
            draft_accepted: 0,
        });
    }

    /// An admitted sequence got its KV; `cached_prompt_tokens` of its prompt are already in it
    /// (prefix reuse; at most `prompt_tokens - 1`).
    pub fn started(&mut self, id: SeqId, cached_prompt_tokens: usize) {
        if let Some(r) = self.running.iter_mut().find(|r| r.id == id) {
            r.prefilled = cached_prompt_tokens.min(r.spec.prompt_tokens - 1);
        }
    }

    /// Preempts a running sequence outside a [`schedule`](Self::schedule) (the shell could not
    /// apply a planned growth): it waits again with prompt + generated tokens as its prompt.
    /// Returns whether it was running.
    pub fn preempt(&mut self, id: SeqId) -> bool {
        let Some(i) = self.running.iter().position(|r| r.id == id) else {
            return false;
        };
        self.preempt_at(i);
        true
    }

    /// An admitted sequence could not get its KV: it goes back to its place in the queue.
    pub fn start_failed(&mut self, id: SeqId) {
        if let Some(i) = self.running.iter().position(|r| r.id == id) {
            self.preempt_at(i);
            self.preemptions -= 1;
        }
    }

    /// Asks for up to `tokens` draft tokens in the steps of decoding sequence `id` (0: none),
    /// until changed: speculative decoding verifies them with the sequence's decode token. The
    /// next [`schedule`](Self::schedule) makes KV room for them if the pool has it free, and
    /// [`next_batch`](Self::next_batch) grants them from the step budget left after the prompt
    /// chunks, at most `max_new_tokens - generated - 1` and `prefill_chunk - 1` (the
    /// granted number is in [`WorkItem::Decode`]). Returns whether `id` is running.
    ///
    /// ```
    /// use gpu_pipeline::engine::{Scheduler, SchedulerConfig, SeqSpec, WorkItem};
    /// let mut s = Scheduler::new(SchedulerConfig::default().with_kv_grow_chunk(16));
    /// s.submit(1, SeqSpec::new(4, 100)).unwrap();
    /// s.schedule(1000);
    /// s.started(1, 0);
    /// s.next_batch();
    /// s.complete_batch(); // the prompt, and the first token
    /// s.set_draft(1, 5);
    /// s.schedule(1000);
    /// assert_eq!(s.next_batch(), vec![WorkItem::Decode { id: 1, draft: 5 }]);
    /// s.drafts_accepted(1, 3); // the step emitted 3 drafts and one token of its own
    /// s.complete_batch();
    /// assert_eq!(s.generated(1), Some(5));
    /// ```
    pub fn set_draft(&mut self, id: SeqId, tokens: usize) -> bool {
        match self.running.iter_mut().find(|r| r.id == id) {
            Some(r) => {
                r.draft_wanted = tokens;
                true
            }
            None => false,
        }
    }

    /// Reports that the step of the last batch accepted `n` of the draft tokens of `id`'s
    /// [`WorkItem::Decode`] (clamped to those granted): the step emitted `1 + n` tokens, which
    /// [`complete_batch`](Self::complete_batch) counts. Call it between
    /// [`next_batch`](Self::next_batch) and `complete_batch`.
    pub fn drafts_accepted(&mut self, id: SeqId, n: usize) {
        let granted = self.last_batch.iter().find_map(|w| match *w {
            WorkItem::Decode { id: d, draft } if d == id => Some(draft),
            _ => None,
        });
        if let (Some(granted), Some(r)) = (granted, self.running.iter_mut().find(|r| r.id == id)) {
            r.draft_accepted = n.min(granted);
        }
    }

    /// The next step: every decoding sequence, then prompt chunks within the token budget,
    /// then the draft tokens decoding sequences asked for within what is left of it.
    /// Remembered until [`complete_batch`](Self::complete_batch).
    pub fn next_batch(&mut self) -> Vec<WorkItem> {
        let mut items = Vec::with_capacity(self.running.len());
        for r in &self.running {
            if r.decoding() {
                items.push(WorkItem::Decode { id: r.id, draft: 0 });
            }
        }
        let decoders = items.len();
        let mut budget = self.cfg.step_token_budget.saturating_sub(items.len());
        let mut prefilling: Vec<&Running> = self
            .running
            .iter()
            .filter(|r| r.prefilled < r.spec.prompt_tokens)
            .collect();
        prefilling.sort_by_key(|r| r.admitted);
        for r in prefilling {
            if budget == 0 {
                break;
            }
            let left = r.spec.prompt_tokens - r.prefilled;
            let len = left.min(self.cfg.prefill_chunk).min(budget);
            budget -= len;
            items.push(WorkItem::Prefill {
                id: r.id,
                start: r.prefilled,
                len,
                last: len == left,
            });
        }
        for (item, r) in items[..decoders]
            .iter_mut()
            .zip(self.running.iter().filter(|r| r.decoding()))
        {
            if budget == 0 {
                break;
            }
            let room = r.reserved.saturating_sub(r.kv_needed_next());
            let draft = r.draft_cap(self.cfg.prefill_chunk).min(room).min(budget);
            budget -= draft;
            *item = WorkItem::Decode { id: r.id, draft };
        }
        self.last_batch.clone_from(&items);
        items
    }

    /// The step planned by [`next_batch`](Self::next_batch) ran: advances the sequences and
    /// returns those that reached `max_new_tokens` (removed from the batch). Items of
    /// sequences cancelled, finished or preempted in between are ignored.
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
                r.generated += 1 + std::mem::take(&mut r.draft_accepted);
                if r.generated >= r.spec.max_new_tokens {
                    done.push(r.id);
                }
            }
        }
        for &id in &done {
            self.finish(id);
        }
        done
    }

    /// A running sequence stopped early (end token, stop sequence, error): removes it.
    pub fn finish(&mut self, id: SeqId) -> bool {
        let Some(i) = self.running.iter().position(|r| r.id == id) else {
            return false;
        };
        let r = self.running.remove(i);
        self.release_client(r.spec.client, |c| {
            c.running -= 1;
            c.kv_tokens -= r.reserved;
        });
        true
    }

    fn release_client(&mut self, client: ClientKey, f: impl FnOnce(&mut ClientUsage)) {
        if let Some(c) = self.clients.get_mut(&client) {
            f(c);
            c.in_flight -= 1;
            if c.in_flight == 0 {
                self.clients.remove(&client);
            }
        }
    }

    /// Removes a request wherever it is (queue or batch). Returns whether it was known.
    pub fn cancel(&mut self, id: SeqId) -> bool {
        if let Some(w) = self.waiting.remove(&id) {
            self.order.remove(&w.key);
            self.queued_tokens -= w.spec.kv_tokens();
            self.release_client(w.spec.client, |c| c.waiting -= 1);
            return true;
        }
        self.finish(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn spec(p: usize, n: usize) -> SeqSpec {
        SeqSpec::new(p, n)
    }

    fn cfg() -> SchedulerConfig {
        SchedulerConfig {
            max_queue: 4,
            max_queued_tokens: 100,
            max_running: 3,
            step_token_budget: 8,
            prefill_chunk: 4,
            kv_budget_tokens: 60,
            kv_grow_chunk: 1000,
            max_running_per_client: usize::MAX,
            max_kv_share_per_client: 1.0,
        }
    }

    /// The engine as the scheduler sees it: a KV pool that is a token counter, and per
    /// sequence the KV positions written, which must stay within what was reserved.
    struct Shell {
        s: Scheduler,
        budget: usize,
        kv: HashMap<SeqId, usize>,
        written: HashMap<SeqId, usize>,
        sampled: HashMap<SeqId, usize>,
        accepted: HashMap<SeqId, SeqSpec>,
        ended: HashSet<SeqId>,
        next_id: SeqId,
    }

    impl Shell {
        fn new(cfg: SchedulerConfig) -> Self {
            Self {
                budget: cfg.kv_budget_tokens,
                s: Scheduler::new(cfg),
                kv: HashMap::new(),
                written: HashMap::new(),
                sampled: HashMap::new(),
                accepted: HashMap::new(),
                ended: HashSet::new(),
                next_id: 0,
            }
        }

        fn submit(&mut self, spec: SeqSpec) -> Result<SeqId, Refusal> {
            let id = self.next_id;
            self.next_id += 1;
            self.s.submit(id, spec)?;
            self.accepted.insert(id, spec);
            Ok(id)
        }

        fn used(&self) -> usize {
            self.kv.values().sum()
        }

        fn end(&mut self, id: SeqId) {
            assert!(self.ended.insert(id), "request {id} ended twice");
            self.kv.remove(&id);
            self.written.remove(&id);
        }

        fn stop(&mut self, id: SeqId, cancel: bool) {
            let known = if cancel {
                self.s.cancel(id)
            } else {
                self.s.finish(id)
            };
            if known {
                self.end(id);
            }
        }

        /// One engine loop turn with `pressure` tokens of the pool held by something else.
        fn step(&mut self, pressure: usize) -> (KvPlan, Vec<SeqId>) {
            let (plan, _, done) = self.step_batch(pressure);
            (plan, done)
        }

        /// [`step`](Self::step), also returning the step's work items.
        fn step_batch(&mut self, pressure: usize) -> (KvPlan, Vec<WorkItem>, Vec<SeqId>) {
            self.step_drafting(pressure, 0)
        }

        /// A step in which every decoding sequence asks for drafts (a function of `seed` and
        /// its id, 0..=4) and accepts some of those granted (likewise): the KV written is
        /// what the step wrote less the rejected drafts (rolled back).
        fn step_drafting(
            &mut self,
            pressure: usize,
            seed: u64,
        ) -> (KvPlan, Vec<WorkItem>, Vec<SeqId>) {
            let mix = |id: SeqId, salt: u64| {
                (id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed.wrapping_mul(salt)) >> 7
            };
            if seed != 0 {
                let ids: Vec<SeqId> = self.s.running.iter().map(|r| r.id).collect();
                for id in ids {
                    self.s.set_draft(id, (mix(id, 31) % 5) as usize);
                }
            }
            let before = self.used();
            let free = self.budget.saturating_sub(before + pressure);
            let plan = self.s.schedule(free);
            for id in &plan.preempt {
                assert!(
                    self.kv.remove(id).is_some(),
                    "preempted {id} was not running"
                );
                self.written.remove(id);
                assert!(self.s.is_waiting(*id));
            }
            for &(id, to) in &plan.grow {
                let old = self
                    .kv
                    .insert(id, to)
                    .expect("growth of a running sequence");
                assert!(to > old, "growth must grow");
            }
            for &(id, cap) in &plan.admit {
                assert!(self.kv.insert(id, cap).is_none());
                self.written.insert(id, 0);
                self.s.started(id, 0);
            }
            let after = self.used();
            assert!(
                after <= self.budget,
                "KV reserved {after} > budget {}",
                self.budget
            );
            assert!(
                after <= before.max(self.budget.saturating_sub(pressure)),
                "planned beyond the free KV"
            );
            assert_eq!(after, self.s.kv_reserved());
            let batch = self.s.next_batch();
            for item in &batch {
                let id = item.id();
                let w = self
                    .written
                    .get_mut(&id)
                    .expect("step of a running sequence");
                *w += item.tokens();
                assert!(*w <= self.kv[&id], "sequence {id} writes past its KV");
                let mut emitted = 1;
                if let WorkItem::Decode { draft, .. } = *item {
                    let accepted = (mix(id, 57) % (draft as u64 + 1)) as usize;
                    self.s.drafts_accepted(id, accepted);
                    *w -= draft - accepted;
                    emitted += accepted;
                }
                if item.samples() {
                    *self.sampled.entry(id).or_default() += emitted;
                }
            }
            let done = self.s.complete_batch();
            for &id in &done {
                self.end(id);
                assert_eq!(self.sampled[&id], self.accepted[&id].max_new_tokens);
            }
            (plan, batch, done)
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
    fn a_client_past_its_in_flight_limit_is_refused_and_others_are_not() {
        let mut s = Scheduler::new(SchedulerConfig {
            max_queue: 100,
            max_running_per_client: 2,
            ..cfg()
        });
        s.submit(1, spec(1, 1).with_client(7)).unwrap();
        s.submit(2, spec(1, 1).with_client(7)).unwrap();
        assert_eq!(
            s.submit(3, spec(1, 1).with_client(7)),
            Err(Refusal::ClientLimit {
                in_flight: 2,
                limit: 2
            })
        );
        s.submit(4, spec(1, 1).with_client(8)).unwrap();
        // Running counts too, not only waiting.
        assert_eq!(s.schedule(60).admit.len(), 3);
        assert!(s.submit(5, spec(1, 1).with_client(7)).is_err());
        assert!(s.finish(1));
        s.submit(5, spec(1, 1).with_client(7)).unwrap();
        assert_eq!(s.client_usage(7).unwrap().in_flight, 2);
        assert!(s.cancel(2) && s.cancel(5));
        assert_eq!(s.client_usage(7), None);
    }

    #[test]
    fn priority_then_fifo_and_no_overtaking() {
        let mut s = Scheduler::new(cfg());
        s.submit(1, spec(5, 5)).unwrap();
        s.submit(2, spec(5, 5).with_priority(5)).unwrap();
        s.submit(3, spec(40, 10)).unwrap();
        s.submit(4, spec(1, 1)).unwrap();
        // 2 first (priority), then 1; 3 needs 50 and does not fit in 30, so 4 waits behind it.
        assert_eq!(s.schedule(30).admit, vec![(2, 10), (1, 10)]);
        s.started(2, 0);
        s.started(1, 0);
        assert!(s.schedule(10).admit.is_empty());
        assert_eq!(s.schedule(60).admit, vec![(3, 50)]);
        s.start_failed(3);
        assert!(s.is_waiting(3));
        assert_eq!(s.schedule(60).admit, vec![(3, 50)]);
    }

    #[test]
    fn chunked_prefill_interleaves_with_decode() {
        let mut s = Scheduler::new(cfg());
        s.submit(1, spec(2, 10)).unwrap();
        s.submit(2, spec(11, 2)).unwrap();
        assert_eq!(s.schedule(100).admit, vec![(1, 12), (2, 13)]);
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
                WorkItem::Decode { id: 1, draft: 0 },
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
            vec![
                WorkItem::Decode { id: 1, draft: 0 },
                WorkItem::Decode { id: 2, draft: 0 }
            ]
        );
        assert_eq!(s.complete_batch(), vec![2]);
        assert_eq!(s.running(), 1);
    }

    fn hoard_cfg() -> SchedulerConfig {
        SchedulerConfig {
            max_queue: 64,
            max_queued_tokens: 1 << 20,
            max_running: 16,
            step_token_budget: 64,
            prefill_chunk: 64,
            kv_budget_tokens: 950,
            kv_grow_chunk: 16,
            ..SchedulerConfig::default()
        }
    }

    /// Finding: five requests of one client with huge `max_tokens` held the whole pool and kept
    /// everybody else out until they finished. (Before: each reserved prompt + max_tokens at
    /// admission, in arrival order, so Y waited behind all of X.)
    #[test]
    fn five_hoarding_requests_of_one_client_do_not_keep_another_client_out() {
        let mut sh = Shell::new(hoard_cfg());
        let xs: Vec<SeqId> = (0..5)
            .map(|_| sh.submit(spec(10, 900).with_client(1)).unwrap())
            .collect();
        // X's five run and grow until the pool is nearly full.
        for _ in 0..165 {
            sh.step(0);
        }
        assert!(
            xs.iter().all(|&x| sh.s.reserved(x).is_some()),
            "all of X run"
        );
        assert!(sh.used() > 900, "X's sequences grew to fill the pool");
        let y = sh.submit(spec(10, 20).with_client(2)).unwrap();
        let mut admitted_at = None;
        for step in 0..5 {
            let (plan, _) = sh.step(0);
            if plan.admit.iter().any(|&(id, _)| id == y) {
                admitted_at = Some(step);
                // Room came from X, the client over its fair share.
                assert!(!plan.preempt.is_empty());
                assert!(plan.preempt.iter().all(|id| xs.contains(id)));
                break;
            }
        }
        assert_eq!(admitted_at, Some(0), "Y is admitted at once");
        let x_running = xs.iter().filter(|&&x| sh.s.reserved(x).is_some()).count();
        assert!(x_running >= 3, "X keeps running: {x_running} of 5");
        // Y finishes while X is still generating, and X is not preempted back and forth.
        for _ in 0..40 {
            sh.step(0);
        }
        assert!(sh.ended.contains(&y));
        assert!(xs.iter().all(|x| !sh.ended.contains(x)));
        // Drain: everybody finishes with all their tokens.
        let mut steps = 0;
        while !sh.s.is_idle() {
            sh.step(0);
            steps += 1;
            assert!(steps < 20_000, "did not drain");
        }
        assert_eq!(sh.ended.len(), 6);
    }

    /// Finding: the whole `max_tokens` was reserved at admission. Now the reservation is the
    /// prompt plus a chunk and grows by chunks, so the pool's use tracks generated tokens.
    #[test]
    fn reservation_grows_by_chunks_and_tracks_use_not_max_tokens() {
        let mut sh = Shell::new(hoard_cfg());
        let id = sh.submit(spec(10, 500)).unwrap();
        let (plan, _) = sh.step(0);
        assert_eq!(
            plan.admit,
            vec![(id, 26)],
            "prompt + one chunk, not prompt + 500"
        );
        let mut grows = 0;
        for _ in 0..200 {
            let (plan, _) = sh.step(0);
            if let Some(&(_, to)) = plan.grow.first() {
                grows += 1;
                assert_eq!(to, 26 + 16 * grows, "one chunk per growth");
            }
            let written = 10 + sh.s.generated(id).unwrap() - 1;
            let reserved = sh.s.reserved(id).unwrap();
            assert!(reserved >= written && reserved <= written + 16);
            assert_eq!(sh.used(), reserved);
        }
        // 201 tokens sampled, 200 in the KV: 210 positions, 12 growths past 26.
        assert_eq!(grows, 12);
        assert!(sh.used() < 260, "used {} tracks use, not 510", sh.used());
    }

    /// When the pool cannot grow a sequence, a victim gives its KV back and is queued again
    /// with its generated tokens as prompt; the others continue; every request ends once, with
    /// all its tokens.
    #[test]
    fn exhaustion_preempts_the_youngest_and_the_others_continue() {
        let mut sh = Shell::new(SchedulerConfig {
            kv_budget_tokens: 100,
            kv_grow_chunk: 10,
            ..hoard_cfg()
        });
        let ids: Vec<SeqId> = (0..3).map(|_| sh.submit(spec(10, 80)).unwrap()).collect();
        let mut first_preempt = None;
        for _ in 0..60 {
            let before: Vec<Option<usize>> = ids.iter().map(|&i| sh.s.generated(i)).collect();
            let (plan, _) = sh.step(0);
            if !plan.preempt.is_empty() && first_preempt.is_none() {
                first_preempt = Some(plan.preempt.clone());
                // The others decoded in that very step.
                for (k, &i) in ids.iter().enumerate() {
                    if !plan.preempt.contains(&i) {
                        assert_eq!(sh.s.generated(i), before[k].map(|g| g + 1));
                    }
                }
            }
        }
        assert_eq!(first_preempt, Some(vec![ids[2]]), "the youngest goes first");
        assert!(sh.s.preemptions() >= 1);
        let mut steps = 0;
        while !sh.s.is_idle() {
            sh.step(0);
            steps += 1;
            assert!(steps < 10_000, "did not drain");
        }
        // Shell::step checked that each ended with exactly max_new_tokens samples.
        assert_eq!(sh.ended.len(), 3);
    }

    #[test]
    fn the_victim_is_the_lowest_priority_before_the_youngest() {
        let mut sh = Shell::new(SchedulerConfig {
            kv_budget_tokens: 100,
            kv_grow_chunk: 10,
            ..hoard_cfg()
        });
        let low = sh.submit(spec(10, 80).with_priority(-1)).unwrap();
        sh.step(0); // admitted first: the oldest
        let others: Vec<SeqId> = (0..2).map(|_| sh.submit(spec(10, 80)).unwrap()).collect();
        let mut victims = Vec::new();
        for _ in 0..40 {
            victims.extend(sh.step(0).0.preempt);
            if !victims.is_empty() {
                break;
            }
        }
        assert_eq!(victims, vec![low]);
        assert!(others.iter().all(|&id| sh.s.reserved(id).is_some()));
    }

    #[test]
    fn a_burst_of_one_client_delays_another_by_one_admission() {
        let mut sh = Shell::new(SchedulerConfig {
            max_queue: 200,
            max_running: 200,
            kv_budget_tokens: 10_000,
            ..hoard_cfg()
        });
        for _ in 0..100 {
            sh.submit(spec(4, 4).with_client(1)).unwrap();
        }
        let y = sh.submit(spec(4, 4).with_client(2)).unwrap();
        // Room for two admissions per turn: X's oldest, then Y (not X's 99 others).
        let plan = sh.s.schedule(16);
        assert_eq!(plan.admit.len(), 2);
        assert_eq!(plan.admit[0].0, 0);
        assert_eq!(plan.admit[1].0, y);
    }

    #[test]
    fn the_share_cap_holds_a_client_back_only_while_others_wait() {
        let mut s = Scheduler::new(SchedulerConfig {
            max_kv_share_per_client: 0.5,
            ..hoard_cfg()
        });
        for id in 0..4 {
            s.submit(id, spec(200, 10).with_client(1)).unwrap();
        }
        // Alone: X may take the whole pool.
        assert_eq!(s.schedule(1000).admit.len(), 4);
        for id in 0..4 {
            s.finish(id);
        }
        for id in 10..14 {
            s.submit(id, spec(200, 10).with_client(1)).unwrap();
        }
        s.submit(20, spec(300, 10).with_client(2)).unwrap();
        s.submit(21, spec(300, 10).with_client(2)).unwrap();
        let admitted: Vec<SeqId> = s.schedule(1000).admit.iter().map(|a| a.0).collect();
        // X stops at half the pool (two of 210) while Y waits; Y gets its turns.
        assert_eq!(admitted, vec![10, 20, 11]);
    }

    #[test]
    fn drafts_take_the_budget_left_after_prefill_and_free_kv_only() {
        let mut s = Scheduler::new(SchedulerConfig {
            step_token_budget: 10,
            prefill_chunk: 6,
            kv_grow_chunk: 2,
            ..cfg()
        });
        s.submit(1, spec(4, 10)).unwrap();
        assert_eq!(s.schedule(60).admit, vec![(1, 6)]);
        s.started(1, 0);
        s.next_batch();
        s.complete_batch();
        // Decoding: 5 KV positions after a plain step, 6 reserved.
        assert!(s.set_draft(1, 5));
        s.submit(2, spec(6, 2)).unwrap();
        // 14 free: request 2 is admitted first (8), then 1 grows for its drafts (5 + 5).
        let plan = s.schedule(14);
        assert_eq!((plan.admit, plan.grow), (vec![(2, 8)], vec![(1, 10)]));
        s.started(2, 0);
        // Budget 10: one decode token, the prompt of 6, then 3 drafts.
        assert_eq!(
            s.next_batch(),
            vec![
                WorkItem::Decode { id: 1, draft: 3 },
                WorkItem::Prefill {
                    id: 2,
                    start: 0,
                    len: 6,
                    last: true
                }
            ]
        );
        s.drafts_accepted(1, 7); // clamped to the 3 granted
        assert!(s.complete_batch().is_empty());
        assert_eq!(s.generated(1), Some(5));
        // 9 of 10 reserved positions in use and 1 token free: no growth (drafts never
        // preempt), one draft in the room left.
        let plan = s.schedule(1);
        assert!(plan.preempt.is_empty() && plan.grow.is_empty());
        assert_eq!(
            s.next_batch(),
            vec![
                WorkItem::Decode { id: 1, draft: 1 },
                WorkItem::Decode { id: 2, draft: 0 }
            ]
        );
        assert_eq!(s.complete_batch(), vec![2]);
        // Never past max_new_tokens: 4 left, so at most 3 drafts.
        s.set_draft(1, 100);
        assert_eq!(s.schedule(60).grow, vec![(1, 13)]);
        assert_eq!(s.next_batch(), vec![WorkItem::Decode { id: 1, draft: 3 }]);
        s.drafts_accepted(1, 3);
        assert_eq!(s.complete_batch(), vec![1]);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Submit(usize, usize, i32, u64),
        Cancel(u64),
        Step(usize),
        /// A step with drafts (see [`Shell::step_drafting`]).
        Draft(usize, u64),
        Stop(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (1usize..30, 1usize..40, -1i32..2, 0u64..3)
                .prop_map(|(p, n, pr, c)| Op::Submit(p, n, pr, c)),
            1 => (0u64..40).prop_map(Op::Cancel),
            6 => prop_oneof![3 => Just(0usize), 1 => 0usize..60].prop_map(Op::Step),
            3 => (prop_oneof![3 => Just(0usize), 1 => 0usize..60], 1u64..1000)
                .prop_map(|(p, seed)| Op::Draft(p, seed)),
            1 => (0u64..40).prop_map(Op::Stop),
        ]
    }

    /// Model-based simulation against the [`Shell`] reference (a token-counting pool and the
    /// KV positions each sequence writes).
    fn simulate(ops: &[Op], cfg: SchedulerConfig) -> Result<(), TestCaseError> {
        let mut sh = Shell::new(cfg.clone());
        for o in ops {
            match *o {
                Op::Submit(p, n, pr, c) => {
                    let _ = sh.submit(spec(p, n).with_priority(pr).with_client(c));
                }
                Op::Cancel(id) => sh.stop(id, true),
                Op::Stop(id) => sh.stop(id, false),
                Op::Step(pressure) | Op::Draft(pressure, _) => {
                    let decoding: Vec<SeqId> =
                        sh.s.running
                            .iter()
                            .filter(|r| r.prefilled == r.spec.prompt_tokens)
                            .map(|r| r.id)
                            .collect();
                    let prefilling = sh.s.running.len() - decoding.len();
                    let seed = if let Op::Draft(_, seed) = *o { seed } else { 0 };
                    let (plan, batch, _) = sh.step_drafting(pressure, seed);
                    let total: usize = batch.iter().map(WorkItem::tokens).sum();
                    prop_assert!(total <= sh.s.cfg.step_token_budget);
                    for id in decoding.iter().filter(|id| !plan.preempt.contains(id)) {
                        prop_assert!(
                            batch
                                .iter()
                                .any(|i| matches!(*i, WorkItem::Decode { id: d, .. } if d == *id)),
                            "a decoding stream was skipped"
                        );
                    }
                    if prefilling > plan.preempt.len() {
                        prop_assert!(
                            batch.iter().any(|i| matches!(i, WorkItem::Prefill { .. })),
                            "prefill starved"
                        );
                    }
                    for i in &batch {
                        if let WorkItem::Prefill { len, .. } = *i {
                            prop_assert!(len <= sh.s.cfg.prefill_chunk);
                        }
                    }
                }
            }
            prop_assert!(sh.s.queue_depth() <= cfg.max_queue + cfg.max_running);
            prop_assert!(sh.s.running() <= cfg.max_running);
            prop_assert!(sh.used() <= cfg.kv_budget_tokens);
            for (&c, u) in &sh.s.clients {
                let held: usize =
                    sh.s.running
                        .iter()
                        .filter(|r| r.spec.client == c)
                        .map(|r| r.reserved)
                        .sum();
                prop_assert_eq!(u.kv_tokens, held);
                prop_assert!(u.in_flight <= cfg.max_running_per_client);
                prop_assert_eq!(u.in_flight, u.waiting + u.running);
            }
        }
        // Drain: with no new arrivals, everything finishes within a bound (no starvation, no
        // livelock between preemptions).
        let work: usize = sh
            .accepted
            .iter()
            .filter(|(id, _)| !sh.ended.contains(id))
            .map(|(_, s)| s.kv_tokens())
            .sum();
        let bound = 2 * work * (1 + sh.accepted.len()) + 10;
        let mut steps = 0;
        while !sh.s.is_idle() {
            sh.step(0);
            steps += 1;
            prop_assert!(steps <= bound, "did not drain within {} steps", bound);
        }
        let accepted: HashSet<SeqId> = sh.accepted.keys().copied().collect();
        prop_assert_eq!(
            &sh.ended,
            &accepted,
            "every accepted request ends exactly once"
        );
        prop_assert!(sh.s.clients.is_empty());
        prop_assert_eq!(sh.s.queued_tokens(), 0);
        Ok(())
    }

    proptest! {
        #[test]
        fn policy_invariants(ops in proptest::collection::vec(op(), 1..200),
                             max_running in 1usize..6, budget in 1usize..12, chunk in 1usize..8,
                             grow in 1usize..12, per_client in 1usize..5, share in 0.2f64..1.0) {
            let cfg = SchedulerConfig {
                max_queue: 6,
                max_queued_tokens: 200,
                max_running,
                step_token_budget: budget,
                prefill_chunk: chunk,
                kv_budget_tokens: 80,
                kv_grow_chunk: grow,
                max_running_per_client: per_client,
                max_kv_share_per_client: share,
            };
            simulate(&ops, cfg)?;
        }
    }
}
