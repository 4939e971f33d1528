//! The loaded graph as a device executor reads it: where every weight's bytes are in the source,
//! the (small) norm and bias vectors, and the RoPE tables. The CUDA executor uploads from here
//! and runs the same stages as [`Model::forward`]; families whose features it has no kernels for
//! are refused by name.

use std::ops::Range;

use weight_cache::GgmlType;

use super::moe::Ffn;
use super::{Lin, Model, RopeLayout, ops};

/// One weight matrix: `rows x cols` of `dtype`, at `bytes` of the source's file `file`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct DeviceTensor {
    pub(crate) file: usize,
    pub(crate) bytes: Range<usize>,
    pub(crate) dtype: GgmlType,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl From<&Lin> for DeviceTensor {
    fn from(l: &Lin) -> Self {
        Self {
            file: l.file,
            bytes: l.bytes.clone(),
            dtype: l.dtype,
            rows: l.rows,
            cols: l.cols,
        }
    }
}

/// One layer.
#[derive(Clone, Debug)]
pub(crate) struct DeviceLayer {
    pub(crate) attn_norm: Vec<f32>,
    pub(crate) wq: DeviceTensor,
    pub(crate) wk: DeviceTensor,
    pub(crate) wv: DeviceTensor,
    pub(crate) wo: DeviceTensor,
    pub(crate) bq: Option<Vec<f32>>,
    pub(crate) bk: Option<Vec<f32>>,
    pub(crate) bv: Option<Vec<f32>>,
    pub(crate) bo: Option<Vec<f32>>,
    pub(crate) ffn_norm: Vec<f32>,
    /// RMSNorm weights of each query and key head (`head_dim` long) or of the whole query and
    /// key rows (OLMoE), applied after the biases and before RoPE (Qwen3, Gemma 3).
    pub(crate) q_norm: Option<Vec<f32>>,
    pub(crate) k_norm: Option<Vec<f32>>,
    /// RMSNorm weights of the attention output and of the MLP output before their residual adds
    /// (Gemma 2 and 3).
    pub(crate) attn_post_norm: Option<Vec<f32>>,
    pub(crate) ffn_post_norm: Option<Vec<f32>>,
    /// The feed-forward block.
    pub(crate) ffn: DeviceFfn,
    /// The RoPE table index and its layout; `None`: no RoPE in this layer.
    pub(crate) rope: Option<(usize, RopeLayout)>,
    pub(crate) window: Option<usize>,
}

impl DeviceLayer {
    /// Every weight matrix of the layer: the attention's, then the feed-forward block's (a
    /// mixture of experts: the router, each expert's gate, up and down, the shared expert's).
    pub(crate) fn matrices(&self) -> Vec<&DeviceTensor> {
        let mut v = vec![&self.wq, &self.wk, &self.wv, &self.wo];
        match &self.ffn {
            DeviceFfn::Dense(m) => v.extend(m),
            DeviceFfn::Moe(moe) => {
                v.push(&moe.router);
                v.extend(moe.experts.iter().flatten());
                if let Some((m, _)) = &moe.shared {
                    v.extend(m);
                }
            }
        }
        v
    }
}

/// A layer's feed-forward block: a gated MLP's gate, up and down matrices, or experts.
#[derive(Clone, Debug)]
pub(crate) enum DeviceFfn {
    Dense([DeviceTensor; 3]),
    Moe(Box<DeviceMoe>),
}

/// A mixture of experts (`model::moe`): routed on the host from the device's router scores,
/// exactly as the CPU routes ([`DeviceMoe::route`]), the experts' products on the device.
#[derive(Clone, Debug)]
pub(crate) struct DeviceMoe {
    /// One row of `n_embd` per expert.
    pub(crate) router: DeviceTensor,
    /// Experts per token.
    pub(crate) n_used: usize,
    /// Each expert's gate, up and down matrices (row ranges of the stacked tensors).
    pub(crate) experts: Vec<[DeviceTensor; 3]>,
    /// Qwen2-MoE's shared expert and its gate vector.
    pub(crate) shared: Option<([DeviceTensor; 3], Vec<f32>)>,
    norm_weights: bool,
    weights_scale: f32,
}

/// [`DeviceMoe::route`]'s result, reused between calls.
#[derive(Debug, Default)]
pub(crate) struct Routing {
    /// Per slot (`token * n_used + rank`): its expert and weight.
    pub(crate) expert: Vec<u32>,
    pub(crate) weight: Vec<f32>,
    /// Expert `e`'s rows (slots grouped by expert, stable) are `start[e]..start[e + 1]`.
    pub(crate) start: Vec<usize>,
    cursor: Vec<usize>,
    /// The slot of each row, and the row of each slot.
    pub(crate) order: Vec<u32>,
    pub(crate) row_of: Vec<u32>,
}

impl DeviceMoe {
    /// Routes `total` tokens from their router scores `probs` (`total x n_experts`, turned into
    /// probabilities in place) as the CPU does (`model::moe::route`, then the slots grouped by
    /// expert).
    pub(crate) fn route(&self, probs: &mut [f32], total: usize, r: &mut Routing) {
        let (ne, k) = (self.experts.len(), self.n_used);
        let slots = total * k;
        r.expert.resize(slots, 0);
        r.weight.resize(slots, 0.0);
        r.start.resize(ne + 1, 0);
        r.cursor.resize(ne, 0);
        r.order.resize(slots, 0);
        r.row_of.resize(slots, 0);
        for t in 0..total {
            super::moe::route(
                &mut probs[t * ne..(t + 1) * ne],
                &mut r.expert[t * k..(t + 1) * k],
                &mut r.weight[t * k..(t + 1) * k],
                self.norm_weights,
                self.weights_scale,
            );
        }
        super::moe::group_slots(
            &r.expert,
            &mut r.start,
            &mut r.cursor,
            &mut r.order,
            &mut r.row_of,
        );
    }
}

/// The whole graph.
#[derive(Clone, Debug)]
pub(crate) struct DeviceGraph {
    pub(crate) embd: DeviceTensor,
    pub(crate) output: DeviceTensor,
    pub(crate) output_norm: Vec<f32>,
    pub(crate) layers: Vec<DeviceLayer>,
    /// RoPE tables (global first).
    pub(crate) n_ropes: usize,
}

impl Model {
    /// The graph for a device executor (every family the CPU runs), or the name of what it
    /// lacks (a mixture of experts without its configuration).
    pub(crate) fn device_graph(&self) -> Result<DeviceGraph, &'static str> {
        let mut layers = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let mlp3 = |m: &super::moe::GatedMlp| -> [DeviceTensor; 3] {
                [(&m.gate).into(), (&m.up).into(), (&m.down).into()]
            };
            let ffn = match &layer.ffn {
                Ffn::Dense(mlp) => DeviceFfn::Dense(mlp3(mlp)),
                Ffn::Moe(ex) => {
                    let m = self
                        .cfg
                        .moe
                        .as_ref()
                        .ok_or("mixture of experts without its configuration")?;
                    DeviceFfn::Moe(Box::new(DeviceMoe {
                        router: (&ex.router).into(),
                        n_used: ex.n_used,
                        experts: ex.experts.iter().map(mlp3).collect(),
                        shared: ex.shared.as_ref().map(|(m, g)| (mlp3(m), g.clone())),
                        norm_weights: m.norm_weights,
                        weights_scale: m.weights_scale,
                    }))
                }
            };
            layers.push(DeviceLayer {
                attn_norm: layer.attn_norm.clone(),
                wq: (&layer.wq).into(),
                wk: (&layer.wk).into(),
                wv: (&layer.wv).into(),
                wo: (&layer.wo).into(),
                bq: layer.bq.clone(),
                bk: layer.bk.clone(),
                bv: layer.bv.clone(),
                bo: layer.bo.clone(),
                ffn_norm: layer.ffn_norm.clone(),
                q_norm: layer.q_norm.clone(),
                k_norm: layer.k_norm.clone(),
                attn_post_norm: layer.attn_post_norm.clone(),
                ffn_post_norm: layer.ffn_post_norm.clone(),
                ffn,
                rope: layer.rope.map(|t| (t, self.ropes[t].layout)),
                window: layer.window,
            });
        }
        Ok(DeviceGraph {
            embd: (&self.embd).into(),
            output: (&self.output).into(),
            output_norm: self.output_norm.clone(),
            layers,
            n_ropes: self.ropes.len(),
        })
    }

    /// RoPE table `table`'s cos/sin row for position `pos` into `out` (`n_rot` floats), as
    /// [`Model::forward`] computes it.
    pub(crate) fn rope_row(&self, table: usize, pos: u64, out: &mut [f32]) {
        let t = &self.ropes[table];
        ops::rope_cos_sin(&t.inv_freq, pos, t.mscale, out);
    }
}
