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

/// One layer (dense MLP, pre-norms only).
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
    pub(crate) gate: DeviceTensor,
    pub(crate) up: DeviceTensor,
    pub(crate) down: DeviceTensor,
    /// The RoPE table index and its layout; `None`: no RoPE in this layer.
    pub(crate) rope: Option<(usize, RopeLayout)>,
    pub(crate) window: Option<usize>,
}

impl DeviceLayer {
    /// The layer's matrices, in the order the forward pass reads them.
    pub(crate) fn matrices(&self) -> [&DeviceTensor; 7] {
        [
            &self.wq, &self.wk, &self.wv, &self.wo, &self.gate, &self.up, &self.down,
        ]
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
    /// The graph for a device executor, or the name of the first feature it does not support
    /// (mixture of experts).
    pub(crate) fn device_graph(&self) -> Result<DeviceGraph, &'static str> {
        let mut layers = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let Ffn::Dense(mlp) = &layer.ffn else {
                return Err("mixture of experts");
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
                gate: (&mlp.gate).into(),
                up: (&mlp.up).into(),
                down: (&mlp.down).into(),
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
