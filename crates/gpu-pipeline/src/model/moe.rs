//! The feed-forward block of a layer: a dense gated MLP, or a mixture of experts (llama.cpp's
//! `build_moe_ffn`: Mixtral's `llama`, `qwen2moe`, `qwen3moe`, `olmoe`).
//!
//! Mixture of experts, per forward call:
//! 1. the router (`ffn_gate_inp`) scores every expert for every token, in f32;
//! 2. per token, softmax over the scores, the `n_used` most probable experts (its *slots*, in
//!    rank order), their probabilities as weights (renormalised to sum 1 where the family does);
//! 3. the slots are grouped by expert (a counting sort, stable in token order), each expert's
//!    tokens gathered into contiguous rows, and its gate/up/down products run once over all of
//!    them: an expert's weights stream once per call, not once per token. The chosen experts'
//!    gate and up products go to the thread pool as one call ([`kernels::matmul_batch`]), their
//!    down products as another: a decode step makes two pool calls per layer, not two per
//!    expert, and each call has every expert's rows to spread over the threads. The experts
//!    are read in the file's layout (not packed at load), so the weight cache's residency
//!    budget governs them: under a budget, a cold expert is read from the file on demand. An
//!    expert's matrices are a contiguous row range of the stacked `ffn_*_exps` tensors (of
//!    `ffn_gate_up_exps`: its gate rows, then its up rows), or tensors of their own (a Hugging
//!    Face checkpoint's per-expert matrices);
//! 4. each token's output is `w_0 * y_0 + w_1 * y_1 + ...` in its rank order, as llama.cpp sums.
//!
//! Batch invariance: the kernels' row results do not depend on the other rows of a product, and
//! a token's sum runs over its own slots in rank order, so a token's output is the same bit for
//! bit whatever else is in the batch (tested in `tests/model_families.rs`, whose families
//! include the MoE ones).

use super::config::MoeConfig;
use super::{Lin, Model, ModelError, Touch, grow, lin, lin_stacked, ops, vector};
use crate::kernels::{self, GgmlType, KernelError, Layout, Product, WeightMatrix};
use crate::model::source::WeightSource;

/// Most products of one [`kernels::matmul_batch`] call here (the most it takes without
/// allocating): the gate and up products of 16 experts.
const PRODUCTS_PER_CALL: usize = 32;

/// A gated MLP's three matrices: `down(act(gate(x)) * up(x))`.
#[derive(Debug)]
pub(super) struct GatedMlp {
    pub(super) gate: Lin,
    pub(super) up: Lin,
    pub(super) down: Lin,
}

/// A layer's mixture of experts.
#[derive(Debug)]
pub(super) struct Experts {
    /// `ffn_gate_inp`: one row of `n_embd` per expert.
    pub(super) router: Lin,
    /// Experts per token in this layer.
    pub(super) n_used: usize,
    /// Each expert's matrices: row ranges of the stacked `ffn_{gate,up,down}_exps` (or of
    /// `ffn_gate_up_exps`), or 2-D tensors of their own.
    pub(super) experts: Vec<GatedMlp>,
    /// The weight-cache indices of the stacked tensors the experts are parts of (each touched
    /// once per expert), when they come from a GGUF file's stacks.
    stacks: Vec<usize>,
    /// Qwen2-MoE's shared expert and its gate vector (`ffn_gate_inp_shexp`).
    pub(super) shared: Option<(GatedMlp, Vec<f32>)>,
}

/// A layer's feed-forward block.
#[derive(Debug)]
pub(super) enum Ffn {
    /// Every token through one gated MLP.
    Dense(GatedMlp),
    /// Each token through its chosen experts (boxed: a layer holds one or the other).
    Moe(Box<Experts>),
}

impl Ffn {
    /// The dense MLP of layer `l` (`ffn_gate`/`ffn_up`/`ffn_down`, or Phi-3's fused `ffn_up`), or
    /// its experts when the model has them, with every shape checked.
    pub(super) fn load(
        g: &dyn WeightSource,
        l: usize,
        d: u64,
        n_ff: u64,
        moe: Option<&MoeConfig>,
    ) -> Result<Self, ModelError> {
        let n = |s: &str| format!("blk.{l}.{s}");
        let Some(m) = moe else {
            // Phi-3 fuses gate and up into one `ffn_up` of 2 n_ff rows, gate first.
            let (gate, up) = match g.tensor(&n("ffn_gate.weight")) {
                Some(_) => (
                    lin(g, &n("ffn_gate.weight"), [d, n_ff])?,
                    lin(g, &n("ffn_up.weight"), [d, n_ff])?,
                ),
                None => {
                    let f = lin(g, &n("ffn_up.weight"), [d, 2 * n_ff])?;
                    let ff = n_ff as usize;
                    (f.slice_rows(0..ff), f.slice_rows(ff..2 * ff))
                }
            };
            let down = lin(g, &n("ffn_down.weight"), [n_ff, d])?;
            return Ok(Self::Dense(GatedMlp { gate, up, down }));
        };
        let (ne, ff) = (m.n_experts as u64, m.n_ff_expert as u64);
        let stacked = |s: &str, shape: [u64; 3]| lin_stacked(g, &n(s), &shape);
        // Expert `e`'s rows of a stack of `per` rows per expert.
        let part = |w: &Lin, e: usize, per: u64| {
            let per = per as usize;
            w.slice_rows(e * per..(e + 1) * per)
        };
        let (nu, fu) = (ne as usize, ff as usize);
        let router = lin(g, &n("ffn_gate_inp.weight"), [d, ne])?;
        let mut stacks = Vec::new();
        // Gate and up: fused (`ffn_gate_up_exps`: per expert, ff gate rows then ff up rows),
        // stacked, or one tensor per expert.
        let (gate, up): (Vec<Lin>, Vec<Lin>) = if g.tensor(&n("ffn_gate_up_exps.weight")).is_some()
        {
            let w = stacked("ffn_gate_up_exps.weight", [d, 2 * ff, ne])?;
            stacks.push(w.tensor);
            (0..nu)
                .map(|e| {
                    let x = part(&w, e, 2 * ff);
                    (x.slice_rows(0..fu), x.slice_rows(fu..2 * fu))
                })
                .unzip()
        } else if g.tensor(&n("ffn_gate_exps.weight")).is_some()
            || g.tensor(&n("ffn_gate_exps.0.weight")).is_none()
        {
            // (Neither stacked nor per expert: the error names the stack.)
            let wg = stacked("ffn_gate_exps.weight", [d, ff, ne])?;
            let wu = stacked("ffn_up_exps.weight", [d, ff, ne])?;
            stacks.extend([wg.tensor, wu.tensor]);
            (0..nu)
                .map(|e| (part(&wg, e, ff), part(&wu, e, ff)))
                .unzip()
        } else {
            let one = |s: &str, e: usize| lin(g, &n(&format!("{s}.{e}.weight")), [d, ff]);
            let mut v = (Vec::with_capacity(nu), Vec::with_capacity(nu));
            for e in 0..nu {
                v.0.push(one("ffn_gate_exps", e)?);
                v.1.push(one("ffn_up_exps", e)?);
            }
            v
        };
        let down: Vec<Lin> = if g.tensor(&n("ffn_down_exps.weight")).is_some()
            || g.tensor(&n("ffn_down_exps.0.weight")).is_none()
        {
            let w = stacked("ffn_down_exps.weight", [ff, d, ne])?;
            stacks.push(w.tensor);
            (0..nu).map(|e| part(&w, e, d)).collect()
        } else {
            (0..nu)
                .map(|e| lin(g, &n(&format!("ffn_down_exps.{e}.weight")), [ff, d]))
                .collect::<Result<_, _>>()?
        };
        let experts = gate
            .into_iter()
            .zip(up)
            .zip(down)
            .map(|((gate, up), down)| GatedMlp { gate, up, down })
            .collect();
        stacks.retain(|&t| t != usize::MAX);
        let shared = match m.n_ff_shared {
            None => None,
            Some(sf) => {
                let sf = sf as u64;
                Some((
                    GatedMlp {
                        gate: lin(g, &n("ffn_gate_shexp.weight"), [d, sf])?,
                        up: lin(g, &n("ffn_up_shexp.weight"), [d, sf])?,
                        down: lin(g, &n("ffn_down_shexp.weight"), [sf, d])?,
                    },
                    vector(g, &n("ffn_gate_inp_shexp.weight"), d)?,
                ))
            }
        };
        Ok(Self::Moe(Box::new(Experts {
            router,
            n_used: m.n_used_per_layer.get(l).copied().unwrap_or(m.n_used),
            experts,
            stacks,
            shared,
        })))
    }
}

/// Buffers of the expert block, grown to the largest batch and then reused (the decode path
/// allocates nothing).
#[derive(Debug, Default)]
pub(super) struct MoeScratch {
    /// Router scores, then probabilities: `n_experts` per token.
    probs: Vec<f32>,
    /// Per slot (`token * n_used + rank`): the chosen expert and its weight.
    expert: Vec<u32>,
    weight: Vec<f32>,
    /// Slots grouped by expert: expert `e`'s slots are `order[start[e]..start[e + 1]]`.
    start: Vec<usize>,
    cursor: Vec<usize>,
    order: Vec<u32>,
    /// Gathered inputs and outputs of the experts, one row per slot in `order`'s order.
    input: Vec<f32>,
    output: Vec<f32>,
    /// Where each slot's row landed in `output`.
    row_of: Vec<u32>,
    /// The experts' gate rows (`n_ff_expert` per slot, in `order`'s order), then their up rows.
    gate_up: Vec<f32>,
    /// The down projections' split inputs (see [`super::ActivationSplit`]): per expert, its
    /// rows' 8-bit-exact parts, then their residuals (`2 * n_ff_expert` per slot).
    split: Vec<f32>,
    /// The down projections' outputs over the split inputs (`2 * n_embd` per slot).
    split_out: Vec<f32>,
    /// The shared expert's output.
    shared: Vec<f32>,
}

impl MoeScratch {
    /// Grows every buffer for `total` tokens of a model with experts `m`.
    pub(super) fn reserve(&mut self, m: &MoeConfig, total: usize, d: usize) {
        let slots = total * m.n_used;
        grow(&mut self.probs, total * m.n_experts);
        grow_u32(&mut self.expert, slots);
        grow(&mut self.weight, slots);
        if self.start.len() < m.n_experts + 1 {
            self.start.resize(m.n_experts + 1, 0);
            self.cursor.resize(m.n_experts, 0);
        }
        grow_u32(&mut self.order, slots);
        grow_u32(&mut self.row_of, slots);
        grow(&mut self.input, slots * d);
        grow(&mut self.output, slots * d);
        grow(&mut self.gate_up, 2 * slots * m.n_ff_expert);
        grow(&mut self.split, 2 * slots * m.n_ff_expert);
        grow(&mut self.split_out, 2 * slots * d);
        if m.n_ff_shared.is_some() {
            grow(&mut self.shared, total * d);
        }
    }
}

fn grow_u32(v: &mut Vec<u32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0);
    }
}

/// Softmax of one token's router scores in place, then its `slots.len()` most probable experts
/// (highest first; equal probabilities: the lower index first) and their weights, divided by
/// their sum when `norm` (the sum clamped below at 2^-14, as llama.cpp does) and multiplied by
/// `scale`.
pub(super) fn route(
    probs: &mut [f32],
    slots: &mut [u32],
    weights: &mut [f32],
    norm: bool,
    scale: f32,
) {
    let max = probs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // ggml_vec_soft_max_f32: the sum in f64, then one f32 reciprocal.
    let mut sum = 0f64;
    for p in probs.iter_mut() {
        *p = (*p - max).exp();
        sum += f64::from(*p);
    }
    let inv = (1.0 / sum) as f32;
    probs.iter_mut().for_each(|p| *p *= inv);
    // Top-k by insertion into the (short) sorted slot list.
    let k = slots.len();
    let mut filled = 0;
    for (e, &p) in probs.iter().enumerate() {
        let mut at = filled;
        while at > 0 && probs[slots[at - 1] as usize] < p {
            at -= 1;
        }
        if at == k {
            continue;
        }
        let end = filled.min(k - 1);
        slots.copy_within(at..end, at + 1);
        slots[at] = e as u32;
        filled = (filled + 1).min(k);
    }
    for (w, &e) in weights.iter_mut().zip(slots.iter()) {
        *w = probs[e as usize];
    }
    if norm {
        let sum: f32 = weights.iter().sum();
        let sum = sum.max(6.103_515_6e-5);
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    if scale != 0.0 && scale != 1.0 {
        weights.iter_mut().for_each(|w| *w *= scale);
    }
}

impl Model {
    /// The gated MLP `mlp` over the `n` rows of `x` into `out` (`n x n_embd`); `gate`/`up` are
    /// scratch of at least `n x inner` each.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gated_mlp(
        &self,
        mlp: &GatedMlp,
        x: &[f32],
        n: usize,
        gate: &mut [f32],
        up: &mut [f32],
        out: &mut [f32],
        tmp2: &mut Vec<f32>,
        touch: Touch<'_>,
    ) -> Result<(), KernelError> {
        let inner = mlp.gate.rows;
        self.mm_group(
            [('g', &mlp.gate), ('u', &mlp.up)],
            x,
            n,
            [&mut *gate, &mut *up],
            tmp2,
            touch,
        )?;
        self.activate(&mut gate[..n * inner], &up[..n * inner], inner);
        self.mm('d', &mlp.down, gate, n, out, tmp2, touch)
    }

    /// `gate = act(gate) * up`, row by row (`inner` wide) in parallel.
    fn activate(&self, gate: &mut [f32], up: &[f32], inner: usize) {
        let gs = ops::SharedRows::new(gate, inner);
        let act = self.cfg.activation;
        self.par_rows(gs.len(), &|r| {
            // SAFETY: tasks get disjoint token ranges.
            let g = unsafe { gs.rows(r.clone()) };
            let u = &up[r.start * inner..r.end * inner];
            match act {
                super::Activation::Silu => ops::silu_mul_rows(g, u),
                super::Activation::GeluTanh => ops::gelu_tanh_mul_rows(g, u),
            }
        });
    }

    /// Step 3 of [`experts`](Self::experts) without split gate/up products: every chosen
    /// expert's gated MLP over its rows of `input` (expert `e`'s are rows `start[e]..start[e +
    /// 1]`) into the same rows of `output`. The gate and up products of all chosen experts run
    /// as one pool call, their down products as another (decode: 2 calls per layer instead of
    /// 2 per expert); each expert's results are the same bit for bit as
    /// [`gated_mlp`](Self::gated_mlp)'s on its rows (the kernels are batch-invariant, and the
    /// element-wise steps run on the same row ranges).
    #[allow(clippy::too_many_arguments)]
    fn expert_mlps(
        &self,
        ex: &Experts,
        start: &[usize],
        input: &[f32],
        gate_up: &mut [f32],
        split: &mut [f32],
        split_out: &mut [f32],
        output: &mut [f32],
    ) -> Result<(), KernelError> {
        let d = self.cfg.n_embd;
        let slots = output.len() / d.max(1);
        let Some(ff) = ex.experts.first().map(|m| m.gate.rows) else {
            return Ok(());
        };
        // The chosen experts, with their first row and row count.
        let active = || {
            (0..ex.experts.len())
                .filter(move |&e| start[e] < start[e + 1])
                .map(move |e| (e, start[e], start[e + 1] - start[e]))
        };
        // Gate rows of expert `e` at row `s` of the gate half, up rows at row `s` of the up half.
        let gate_up = &mut gate_up[..2 * slots * ff];
        self.batch(
            active().flat_map(|(e, s, n)| {
                let m = &ex.experts[e];
                [(&m.gate, s, n, s * ff), (&m.up, s, n, (slots + s) * ff)]
            }),
            input,
            d,
            gate_up,
        )?;
        let (gate, up) = gate_up.split_at_mut(slots * ff);
        for (_, s, n) in active() {
            let rows = s * ff..(s + n) * ff;
            self.activate(&mut gate[rows.clone()], &up[rows], ff);
        }
        if !ex.experts.iter().all(|m| self.split_for('d', &m.down)) {
            return self.batch(
                active().map(|(e, s, n)| (&ex.experts[e].down, s, n, s * d)),
                gate,
                ff,
                output,
            );
        }
        // The down products split for precision, as `matmul_split` computes them: per expert,
        // its rows as they are, then the residuals their 8-bit quantization leaves, as 2n rows
        // of one product, then the two results added.
        let split = &mut split[..2 * slots * ff];
        for (_, s, n) in active() {
            let x = &gate[s * ff..(s + n) * ff];
            let (h, lo) = split[2 * s * ff..2 * (s + n) * ff].split_at_mut(n * ff);
            let (hs, ls) = (ops::SharedRows::new(h, ff), ops::SharedRows::new(lo, ff));
            self.par_rows(n, &|r| {
                // SAFETY: tasks get disjoint token ranges.
                let (h, lo) = unsafe { (hs.rows(r.clone()), ls.rows(r.clone())) };
                let x = &x[r.start * ff..r.end * ff];
                h.copy_from_slice(x);
                ops::split_residual(x, lo);
            });
        }
        let split_out = &mut split_out[..2 * slots * d];
        self.batch(
            active().map(|(e, s, n)| (&ex.experts[e].down, 2 * s, 2 * n, 2 * s * d)),
            split,
            ff,
            split_out,
        )?;
        for (_, s, n) in active() {
            let (a, b) = split_out[2 * s * d..2 * (s + n) * d].split_at(n * d);
            let ys = ops::SharedRows::new(&mut output[s * d..(s + n) * d], d);
            self.par_rows(n, &|r| {
                let (a, b) = (&a[r.start * d..r.end * d], &b[r.start * d..r.end * d]);
                // SAFETY: tasks get disjoint token ranges.
                ops::add_to(a, b, unsafe { ys.rows(r) });
            });
        }
        Ok(())
    }

    /// The products `(matrix, first token, tokens, output offset)` over the tokens of `x`
    /// (`cols` wide) into `y`, [`PRODUCTS_PER_CALL`] per pool call.
    fn batch<'l>(
        &self,
        products: impl Iterator<Item = (&'l Lin, usize, usize, usize)>,
        x: &[f32],
        cols: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        let empty = Product {
            w: WeightMatrix {
                dtype: GgmlType::F32,
                rows: 0,
                cols,
                data: &[],
                layout: Layout::File,
            },
            first: 0,
            n: 0,
            out: 0,
        };
        let mut buf = [empty; PRODUCTS_PER_CALL];
        let mut len = 0;
        for (l, first, n, out) in products {
            buf[len] = Product {
                w: self.w(l)?,
                first,
                n,
                out,
            };
            len += 1;
            if len == PRODUCTS_PER_CALL {
                kernels::matmul_batch(&buf, x, cols, y, self.pool())?;
                len = 0;
            }
        }
        if len > 0 {
            kernels::matmul_batch(&buf[..len], x, cols, y, self.pool())?;
        }
        Ok(())
    }

    /// The expert block over the `total` normalized rows `h` into `out` (`total x n_embd`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn experts(
        &self,
        ex: &Experts,
        h: &[f32],
        total: usize,
        sc: &mut MoeScratch,
        gate: &mut [f32],
        up: &mut [f32],
        out: &mut [f32],
        tmp2: &mut Vec<f32>,
        touch: Touch<'_>,
    ) -> Result<(), KernelError> {
        let Some(m) = &self.cfg.moe else {
            return Ok(());
        };
        let (d, ne, k) = (self.cfg.n_embd, m.n_experts, ex.n_used);
        let slots = total * k;
        // 1-2: router scores in f32, then each token's experts and weights.
        ex.router.touch(touch);
        self.matmul(&ex.router, h, total, &mut sc.probs)?;
        for t in 0..total {
            route(
                &mut sc.probs[t * ne..(t + 1) * ne],
                &mut sc.expert[t * k..(t + 1) * k],
                &mut sc.weight[t * k..(t + 1) * k],
                m.norm_weights,
                m.weights_scale,
            );
        }
        // 3: slots grouped by expert (counting sort, stable in slot order).
        group_slots(
            &sc.expert[..slots],
            &mut sc.start[..ne + 1],
            &mut sc.cursor[..ne],
            &mut sc.order[..slots],
            &mut sc.row_of[..slots],
        );
        let start = &sc.start[..ne + 1];
        for (row, &slot) in sc.order[..slots].iter().enumerate() {
            let t = slot as usize / k;
            sc.input[row * d..(row + 1) * d].copy_from_slice(&h[t * d..(t + 1) * d]);
        }
        // Only the chosen experts' rows of the stacked tensors are read.
        if let Some((c, r)) = touch {
            for e in (0..ne).filter(|&e| start[e] < start[e + 1]) {
                for &t in &ex.stacks {
                    c.touch_part(t, e, r);
                }
            }
        }
        if ex
            .experts
            .iter()
            .any(|m| self.split_for('g', &m.gate) || self.split_for('u', &m.up))
        {
            // Every product split for precision: expert by expert.
            for e in (0..ne).filter(|&e| start[e] < start[e + 1]) {
                let rows = start[e]..start[e + 1];
                self.gated_mlp(
                    &ex.experts[e],
                    &sc.input[rows.start * d..rows.end * d],
                    rows.len(),
                    gate,
                    up,
                    &mut sc.output[rows.start * d..rows.end * d],
                    tmp2,
                    None,
                )?;
            }
        } else {
            self.expert_mlps(
                ex,
                start,
                &sc.input[..slots * d],
                &mut sc.gate_up,
                &mut sc.split,
                &mut sc.split_out,
                &mut sc.output[..slots * d],
            )?;
        }
        // 4: each token's weighted sum in rank order.
        for t in 0..total {
            let o = &mut out[t * d..(t + 1) * d];
            for r in 0..k {
                let s = t * k + r;
                let w = sc.weight[s];
                let y = &sc.output[sc.row_of[s] as usize * d..][..d];
                if r == 0 {
                    o.iter_mut().zip(y).for_each(|(o, &y)| *o = w * y);
                } else {
                    o.iter_mut().zip(y).for_each(|(o, &y)| *o += w * y);
                }
            }
        }
        if let Some((mlp, gate_inp)) = &ex.shared {
            self.shared_expert(mlp, gate_inp, h, total, sc, gate, up, out, tmp2, touch)?;
        }
        Ok(())
    }

    /// Qwen2-MoE's shared expert: `out += sigmoid(gate_inp · h) * mlp(h)` per token.
    #[allow(clippy::too_many_arguments)]
    fn shared_expert(
        &self,
        mlp: &GatedMlp,
        gate_inp: &[f32],
        h: &[f32],
        total: usize,
        sc: &mut MoeScratch,
        gate: &mut [f32],
        up: &mut [f32],
        out: &mut [f32],
        tmp2: &mut Vec<f32>,
        touch: Touch<'_>,
    ) -> Result<(), KernelError> {
        let d = self.cfg.n_embd;
        self.gated_mlp(mlp, h, total, gate, up, &mut sc.shared, tmp2, touch)?;
        for t in 0..total {
            let x: f32 = h[t * d..(t + 1) * d]
                .iter()
                .zip(gate_inp)
                .map(|(a, b)| a * b)
                .sum();
            // ggml: silu(x) / x.
            let s = x / (1.0 + (-x).exp()) / x;
            let y = &sc.shared[t * d..(t + 1) * d];
            out[t * d..(t + 1) * d]
                .iter_mut()
                .zip(y)
                .for_each(|(o, &y)| *o += y * s);
        }
        Ok(())
    }
}

/// Groups the slots by expert (`expert[s]` is slot `s`'s expert), stable in slot order:
/// expert `e`'s rows are `start[e]..start[e + 1]`, `order` lists the slots by row and `row_of`
/// gives each slot's row. `cursor` is scratch of one entry per expert.
pub(super) fn group_slots(
    expert: &[u32],
    start: &mut [usize],
    cursor: &mut [usize],
    order: &mut [u32],
    row_of: &mut [u32],
) {
    start.fill(0);
    for &e in expert {
        start[e as usize + 1] += 1;
    }
    for e in 0..cursor.len() {
        start[e + 1] += start[e];
    }
    cursor.copy_from_slice(&start[..cursor.len()]);
    for (s, &e) in expert.iter().enumerate() {
        let row = cursor[e as usize];
        cursor[e as usize] += 1;
        order[row] = s as u32;
        row_of[s] = row as u32;
    }
}

#[cfg(test)]
mod tests {
    use super::route;

    #[test]
    fn route_picks_the_most_probable_experts_in_rank_order() {
        let mut p = [0.5f32, 3.0, -1.0, 2.0, 2.5];
        let (mut s, mut w) = ([0u32; 2], [0f32; 2]);
        route(&mut p, &mut s, &mut w, true, 1.0);
        assert_eq!(s, [1, 4]);
        let (a, b) = (3.0f32.exp(), 2.5f32.exp());
        assert!((w[0] - a / (a + b)).abs() < 1e-6 && (w[0] + w[1] - 1.0).abs() < 1e-6);
        // Without renormalisation the weights are the softmax probabilities.
        let mut p = [0.0f32, 0.0, 1.0, 0.0];
        route(&mut p, &mut s, &mut w, false, 1.0);
        let z = 3.0 + 1f32.exp();
        assert_eq!(s, [2, 0]);
        assert!((w[0] - 1f32.exp() / z).abs() < 1e-6 && (w[1] - 1.0 / z).abs() < 1e-6);
    }

    #[test]
    fn slots_group_by_expert_in_slot_order() {
        let expert = [2u32, 0, 2, 1, 0, 2];
        let (mut start, mut cursor) = ([0usize; 4], [0usize; 3]);
        let (mut order, mut row_of) = ([0u32; 6], [0u32; 6]);
        super::group_slots(&expert, &mut start, &mut cursor, &mut order, &mut row_of);
        assert_eq!(start, [0, 2, 3, 6]);
        assert_eq!(order, [1, 4, 3, 0, 2, 5]);
        for (s, &r) in row_of.iter().enumerate() {
            assert_eq!(order[r as usize] as usize, s);
        }
    }
}
