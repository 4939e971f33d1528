//! KV rings in device memory: the [`KvStorage`] a ring keeps on the GPU ([`DeviceKv`]), and
//! the per-forward tables through which `kv_scatter` writes each layer's new rows into the
//! rings and `attention_ring` reads them in place ([`RingTables`]).
//!
//! Every operation on a [`DeviceKv`] (allocation, growth, the ring's sink moves and fork
//! copies, the executor's kernels) is issued on one stream: the pool's allocator, which the
//! executor sets to its compute stream. Stream order is the synchronization; nothing relies
//! on cudarc's per-buffer events (the kernels reach the rings through raw addresses).

use std::sync::Arc;

use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, DevicePtr, DeviceRepr, DriverError, LaunchConfig,
    PushKernelArg, ValidAsZeroBits,
};
use kv_ring::{KvDtype, KvError, KvStorage, KvTensor, StorageOp};

use super::CudaError;
use super::kernels::ATT_THREADS;
use crate::model::SeqStep;

/// A ring's K/V elements in one device buffer, in the pool's dtype (`f32`, or `f16` as IEEE
/// half bits), blocks back to back like [`kv_ring::HostKv`]: block `b` (see [`KvStorage`]) is
/// elements [`block_offset(b)`](Self::block_offset)`..block_offset(b + 1)`.
///
/// The ring does the slot arithmetic ([`KvRing::layer_slots`](kv_ring::KvRing::layer_slots)); the CUDA executor's
/// `kv_scatter` kernel writes a layer's new rows at those slots (converting to `f16` with
/// round-to-nearest-even, as the host ring does) and `attention_ring` reads the blocks in
/// place. The allocator is the stream every operation is ordered on.
#[derive(Debug)]
pub struct DeviceKv {
    /// `None` for the empty placeholder (no allocation).
    buf: Option<CudaSlice<u8>>,
    dtype: KvDtype,
    /// Block `b` is elements `bounds[b]..bounds[b + 1]` of `buf`.
    bounds: Box<[usize]>,
    /// Staging for overlapping copies inside the buffer (sink moves of sliding rings).
    tmp: Option<CudaSlice<u8>>,
}

fn prefix_bounds(block_lens: &[usize]) -> Box<[usize]> {
    std::iter::once(0)
        .chain(block_lens.iter().scan(0usize, |end, &len| {
            *end += len;
            Some(*end)
        }))
        .collect()
}

fn failed(op: StorageOp, bytes: usize) -> impl FnOnce(DriverError) -> KvError {
    move |e| KvError::StorageFailed {
        op,
        bytes,
        reason: e.to_string(),
    }
}

impl DeviceKv {
    /// The element type of the buffer.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Element offset of block `block` in [`buffer`](Self::buffer) (`block` up to the block
    /// count: the end).
    pub fn block_offset(&self, block: usize) -> usize {
        self.bounds[block]
    }

    /// The device buffer, as bytes (`None` only for a dropped ring's placeholder).
    pub fn buffer(&self) -> Option<&CudaSlice<u8>> {
        self.buf.as_ref()
    }

    /// The device buffer, writable (a writer other than the executor's kernels places rows at
    /// the ring's [`layer_slots`](kv_ring::KvRing::layer_slots), then marks the layer written).
    pub fn buffer_mut(&mut self) -> Option<&mut CudaSlice<u8>> {
        self.buf.as_mut()
    }

    /// The buffer's device address (`None` for the placeholder). Taken once per ring and
    /// forward pass: each call records a read event when cudarc tracks events.
    pub(crate) fn base_address(&self) -> Option<u64> {
        let buf = self.buf.as_ref()?;
        let (ptr, _record) = buf.device_ptr(buf.stream());
        Some(ptr)
    }

    /// Whether the buffer lives on `stream` (the executor's compute stream).
    pub(crate) fn is_on(&self, stream: &Arc<CudaStream>) -> bool {
        self.buf
            .as_ref()
            .is_some_and(|b| Arc::ptr_eq(b.stream(), stream))
    }

    /// Bytes per element: 4 or 2 (other dtypes are refused at allocation, see `supports`, so
    /// only an empty buffer of one exists, and it never addresses elements).
    fn elem(&self) -> usize {
        self.dtype.bytes_for(1).unwrap_or(0)
    }
}

impl KvStorage for DeviceKv {
    type Allocator = Arc<CudaStream>;

    fn zeroed(
        stream: &Arc<CudaStream>,
        dtype: KvDtype,
        block_lens: &[usize],
    ) -> Result<Self, KvError> {
        let bounds = prefix_bounds(block_lens);
        let elems = bounds[bounds.len() - 1];
        let bytes = dtype.bytes_for(elems).unwrap_or(usize::MAX);
        if !Self::supports(stream, dtype) {
            return Err(KvError::UnsupportedDtype { dtype });
        }
        let buf = stream
            .alloc_zeros::<u8>(bytes)
            .map_err(failed(StorageOp::Alloc, bytes))?;
        Ok(Self {
            buf: Some(buf),
            dtype,
            bounds,
            tmp: None,
        })
    }

    /// F32 and F16 (the attention kernels read those).
    fn supports(_: &Arc<CudaStream>, dtype: KvDtype) -> bool {
        matches!(dtype, KvDtype::F32 | KvDtype::F16)
    }

    fn empty(dtype: KvDtype) -> Self {
        Self {
            buf: None,
            dtype,
            bounds: Box::new([0]),
            tmp: None,
        }
    }

    /// The ring's buffer only (the staging buffer of sink moves is scratch, at most the sinks'
    /// rows of one block, and not counted).
    fn allocated_bytes(&self) -> usize {
        self.buf.as_ref().map_or(0, CudaSlice::len)
    }

    /// A new buffer and one device-to-device copy per block; the old buffer is freed in stream
    /// order after the copies.
    fn grow_blocks(
        &mut self,
        stream: &Arc<CudaStream>,
        block_lens: &[usize],
    ) -> Result<(), KvError> {
        assert_eq!(block_lens.len() + 1, self.bounds.len(), "same block count");
        let bounds = prefix_bounds(block_lens);
        let e = self.elem();
        let bytes = bounds[bounds.len() - 1] * e;
        let mut new = stream
            .alloc_zeros::<u8>(bytes)
            .map_err(failed(StorageOp::Grow, bytes))?;
        if let Some(old) = &self.buf {
            for b in 0..block_lens.len() {
                let (o, len) = (
                    self.bounds[b] * e,
                    (self.bounds[b + 1] - self.bounds[b]) * e,
                );
                if len > 0 {
                    let at = bounds[b] * e;
                    stream
                        .memcpy_dtod(&old.slice(o..o + len), &mut new.slice_mut(at..at + len))
                        .map_err(failed(StorageOp::Grow, len))?;
                }
            }
        }
        self.buf = Some(new);
        self.bounds = bounds;
        Ok(())
    }

    /// Through a staging buffer: the runs may overlap, which a device-to-device copy does not
    /// allow.
    fn copy_within(
        &mut self,
        block: usize,
        src: usize,
        dst: usize,
        len: usize,
    ) -> Result<(), KvError> {
        if len == 0 {
            return Ok(());
        }
        debug_assert!(self.bounds[block] + src.max(dst) + len <= self.bounds[block + 1]);
        let e = self.elem();
        let (from, to, bytes) = (
            (self.bounds[block] + src) * e,
            (self.bounds[block] + dst) * e,
            len * e,
        );
        let buf = self
            .buf
            .as_mut()
            .expect("copies only happen on a live ring");
        let stream = Arc::clone(buf.stream());
        if self.tmp.as_ref().is_none_or(|t| t.len() < bytes) {
            self.tmp = Some(
                stream
                    .alloc_zeros::<u8>(bytes)
                    .map_err(failed(StorageOp::Copy, bytes))?,
            );
        }
        let tmp = self.tmp.as_mut().expect("allocated above");
        stream
            .memcpy_dtod(&buf.slice(from..from + bytes), &mut tmp.slice_mut(0..bytes))
            .map_err(failed(StorageOp::Copy, bytes))?;
        stream
            .memcpy_dtod(&tmp.slice(0..bytes), &mut buf.slice_mut(to..to + bytes))
            .map_err(failed(StorageOp::Copy, bytes))
    }

    fn copy_from(
        &mut self,
        block: usize,
        dst: usize,
        other: &Self,
        src_block: usize,
        src: usize,
        len: usize,
    ) -> Result<(), KvError> {
        if len == 0 {
            return Ok(());
        }
        let e = self.elem();
        let (to, from, bytes) = (
            (self.bounds[block] + dst) * e,
            (other.bounds[src_block] + src) * e,
            len * e,
        );
        let other_buf = other.buf.as_ref().expect("a live ring's storage");
        let buf = self
            .buf
            .as_mut()
            .expect("copies only happen on a live ring");
        let stream = Arc::clone(buf.stream());
        stream
            .memcpy_dtod(
                &other_buf.slice(from..from + bytes),
                &mut buf.slice_mut(to..to + bytes),
            )
            .map_err(failed(StorageOp::Copy, bytes))
    }
}

/// A ring storage the CUDA executor can run on: a [`DeviceKv`], or a storage chosen at run
/// time that may hold one ([`HostedKv`](crate::executor::HostedKv)).
pub(crate) trait DeviceRing: KvStorage {
    /// The device storage, if this value is one.
    fn device_kv(&self) -> Option<&DeviceKv>;
}

impl DeviceRing for DeviceKv {
    fn device_kv(&self) -> Option<&DeviceKv> {
        Some(self)
    }
}

/// A forward pass's failure on the device path: the device's, or a ring's (step index, error).
#[derive(Debug)]
pub(crate) enum StepError {
    Device(CudaError),
    Kv(usize, KvError),
}

impl From<CudaError> for StepError {
    fn from(e: CudaError) -> Self {
        Self::Device(e)
    }
}

/// A ring error of step `step`.
pub(crate) fn kv_err(step: usize) -> impl FnOnce(KvError) -> StepError {
    move |source| StepError::Kv(step, source)
}

fn u32_of(what: &'static str, value: usize) -> Result<u32, CudaError> {
    u32::try_from(value).map_err(|_| CudaError::TooLarge { what, value })
}

/// Copies `host` to the start of `buf`, growing it (to at least one element) when too small.
fn upload<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    host: &[T],
    buf: &mut CudaSlice<T>,
) -> Result<(), CudaError> {
    if buf.len() < host.len() {
        *buf = stream
            .alloc_zeros(host.len())
            .map_err(CudaError::driver("alloc ring tables"))?;
    }
    if !host.is_empty() {
        stream
            .memcpy_htod(host, &mut buf.slice_mut(0..host.len()))
            .map_err(CudaError::driver("upload ring tables"))?;
    }
    Ok(())
}

/// Step `i`'s ring storage, if it is a [`DeviceKv`] on `stream`.
fn on_device<'a, S: DeviceRing>(
    step: &'a SeqStep<'_, S>,
    i: usize,
    stream: &Arc<CudaStream>,
) -> Result<&'a DeviceKv, CudaError> {
    step.kv
        .storage()
        .device_kv()
        .filter(|d| d.is_on(stream))
        .ok_or(CudaError::RingNotOnDevice { step: i })
}

/// Per step: `[slot of view index 0, rows kept, 1 if f16]` (`GEOM` words) per layer.
const GEOM: usize = 3;
/// Per token: `[first key, keys]` (view indices) per layer.
const TOK: usize = 2;

/// Where every step's rows are, for every layer of one forward pass, built once after the
/// rings' `begin` (a ring's slots do not move until `commit`) and uploaded in one copy per
/// table: O(layers x (steps x kv heads + tokens)) words, independent of the context.
///
/// Layout (`ns` steps, `total` tokens, `kvh` kv heads), each table layer-major:
/// - `blocks`: `u64` device addresses of the K and V blocks, `[layer][step][kv head][K, V]`;
/// - `geom`: `[layer][step][start, rows kept, f16]` (slot of view index `i` is
///   `(start + i) % rows kept`, [`kv_ring::LayerSlots`]);
/// - `toks`: `[layer][token][first, keys]`: query token `j` of its step attends to view
///   indices `first..keys`, with `keys = committed + j + 1` (causal; the pending token itself
///   is view index `keys - 1`, where `kv_scatter` writes it) and `first = keys - window` for a
///   window layer (else 0), as the CPU attention bounds them;
/// - `tok_step`: `[token]` the token's step.
pub(crate) struct RingTables {
    /// Per step, its ring buffer's device address.
    bases: Vec<u64>,
    blocks_h: Vec<u64>,
    geom_h: Vec<u32>,
    toks_h: Vec<u32>,
    tok_step_h: Vec<u32>,
    blocks: CudaSlice<u64>,
    geom: CudaSlice<u32>,
    toks: CudaSlice<u32>,
    tok_step: CudaSlice<u32>,
    steps: usize,
    total: usize,
    kv_heads: usize,
    /// The most keys any query attends to (the `scores` scratch row length).
    max_keys: usize,
}

impl RingTables {
    /// Empty tables (one-element device buffers, grown by [`build`](Self::build)).
    pub(crate) fn new(stream: &Arc<CudaStream>) -> Result<Self, CudaError> {
        fn one<T: DeviceRepr + ValidAsZeroBits>(
            stream: &Arc<CudaStream>,
        ) -> Result<CudaSlice<T>, CudaError> {
            stream
                .alloc_zeros(1)
                .map_err(CudaError::driver("alloc ring tables"))
        }
        Ok(Self {
            bases: Vec::new(),
            blocks_h: Vec::new(),
            geom_h: Vec::new(),
            toks_h: Vec::new(),
            tok_step_h: Vec::new(),
            blocks: one(stream)?,
            geom: one(stream)?,
            toks: one(stream)?,
            tok_step: one(stream)?,
            steps: 0,
            total: 0,
            kv_heads: 0,
            max_keys: 0,
        })
    }

    /// The most keys a query attends to in this pass.
    pub(crate) fn max_keys(&self) -> usize {
        self.max_keys
    }

    /// Fills and uploads the tables for `steps`, whose rings have begun their chunks, over
    /// layers with attention `windows`. Every ring must be a [`DeviceKv`] on `stream`
    /// ([`CudaError::RingNotOnDevice`] otherwise).
    pub(crate) fn build<S: DeviceRing>(
        &mut self,
        steps: &[SeqStep<'_, S>],
        windows: &[Option<usize>],
        stream: &Arc<CudaStream>,
    ) -> Result<(), StepError> {
        let shape = match steps.first() {
            Some(s) => s.kv.pool().shape(),
            None => return Ok(()),
        };
        let kvh = shape.n_kv_heads;
        self.steps = steps.len();
        self.total = steps.iter().map(|s| s.tokens.len()).sum();
        self.kv_heads = kvh;
        self.max_keys = 0;
        self.blocks_h.clear();
        self.geom_h.clear();
        self.toks_h.clear();
        self.tok_step_h.clear();
        self.bases.clear();
        for (i, s) in steps.iter().enumerate() {
            let base = on_device(s, i, stream)?
                .base_address()
                .ok_or(CudaError::RingNotOnDevice { step: i })?;
            self.bases.push(base);
            let step = u32_of("steps", i)?;
            self.tok_step_h
                .extend(std::iter::repeat_n(step, s.tokens.len()));
        }
        for (li, window) in windows.iter().enumerate() {
            for (i, s) in steps.iter().enumerate() {
                let dkv = on_device(s, i, stream)?;
                let (base, elem) = (self.bases[i], dkv.elem() as u64);
                for g in 0..kvh {
                    for tensor in [KvTensor::K, KvTensor::V] {
                        let b = s.kv.block_index(li, g, tensor);
                        self.blocks_h.push(base + dkv.block_offset(b) as u64 * elem);
                    }
                }
                let slots = s.kv.layer_slots(li).map_err(kv_err(i))?;
                self.geom_h.extend([
                    u32_of("ring slot", slots.start)?,
                    u32_of("ring rows", slots.rows_kept)?,
                    u32::from(dkv.dtype() == KvDtype::F16),
                ]);
                for j in 0..s.tokens.len() {
                    let keys = slots.committed + j + 1;
                    let first = window.map_or(0, |w| keys.saturating_sub(w));
                    self.toks_h
                        .extend([u32_of("keys", first)?, u32_of("keys", keys)?]);
                    self.max_keys = self.max_keys.max(keys);
                }
            }
        }
        upload(stream, &self.blocks_h, &mut self.blocks)?;
        upload(stream, &self.geom_h, &mut self.geom)?;
        upload(stream, &self.toks_h, &mut self.toks)?;
        upload(stream, &self.tok_step_h, &mut self.tok_step)?;
        Ok(())
    }

    /// Layer `layer`'s slices of the tables: (blocks, geom, toks).
    fn layer(&self, layer: usize) -> (CudaView<'_, u64>, CudaView<'_, u32>, CudaView<'_, u32>) {
        let (nb, ng, nt) = (
            self.steps * self.kv_heads * 2,
            self.steps * GEOM,
            self.total * TOK,
        );
        (
            self.blocks.slice(layer * nb..(layer + 1) * nb),
            self.geom.slice(layer * ng..(layer + 1) * ng),
            self.toks.slice(layer * nt..(layer + 1) * nt),
        )
    }

    /// Writes layer `layer`'s new rows, `k` and `v` `[total][kv heads][head_dim]` `f32`, into
    /// every step's ring (the caller then marks the layer written on each ring).
    pub(crate) fn scatter(
        &self,
        stream: &Arc<CudaStream>,
        kernel: &cudarc::driver::CudaFunction,
        layer: usize,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        head_dim: usize,
    ) -> Result<(), CudaError> {
        let (blocks, geom, toks) = self.layer(layer);
        let (kvh, hd) = (
            u32_of("kv heads", self.kv_heads)?,
            u32_of("head_dim", head_dim)?,
        );
        let mut b = stream.launch_builder(kernel);
        b.arg(k)
            .arg(v)
            .arg(&kvh)
            .arg(&hd)
            .arg(&blocks)
            .arg(&geom)
            .arg(&self.tok_step)
            .arg(&toks);
        let cfg = LaunchConfig {
            grid_dim: (u32_of("rows", self.total * self.kv_heads)?, 1, 1),
            block_dim: (hd.min(128), 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `kv_scatter(const float*, const float*, u32, u32,
        // const u64*, const u32*, const u32*, const u32*)`. `k` and `v` hold `total * kv_heads
        // * head_dim` floats (the executor's scratch for this pass). The tables were built by
        // `build` for these steps after their `begin`: each address is a K or V block of a
        // live ring's buffer (the rings are borrowed for the whole pass, and a buffer freed
        // later is freed in this stream's order), and the row written, slot `(start + keys -
        // 1) % rows kept` with `keys <= rows kept`, lies inside its block of `rows kept *
        // head_dim` elements of the ring's dtype (the f16 flag).
        unsafe { b.launch(cfg) }.map_err(CudaError::driver("kv_scatter"))?;
        Ok(())
    }

    /// Attention of every token's query heads against its ring's layer `layer` (after
    /// [`scatter`](Self::scatter)), into `out` `[total][heads][head_dim]`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attend(
        &self,
        stream: &Arc<CudaStream>,
        kernel: &cudarc::driver::CudaFunction,
        layer: usize,
        q: &CudaSlice<f32>,
        (heads, head_dim): (usize, usize),
        (scale, cap): (f32, f32),
        scores: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let (blocks, geom, toks) = self.layer(layer);
        let (h32, kv32, hd32, mk32) = (
            u32_of("heads", heads)?,
            u32_of("kv heads", self.kv_heads)?,
            u32_of("head_dim", head_dim)?,
            u32_of("keys", self.max_keys)?,
        );
        let mut b = stream.launch_builder(kernel);
        b.arg(q)
            .arg(&blocks)
            .arg(&geom)
            .arg(&self.tok_step)
            .arg(&toks)
            .arg(&h32)
            .arg(&kv32)
            .arg(&hd32)
            .arg(&scale)
            .arg(&cap)
            .arg(scores)
            .arg(&mk32)
            .arg(out);
        let cfg = LaunchConfig {
            grid_dim: (u32_of("rows", self.total * heads)?, 1, 1),
            block_dim: (ATT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `attention_ring(const float*, const u64*, const u32*,
        // const u32*, const u32*, u32, u32, u32, float, float, float*, u32, float*)`. `q` holds
        // `total * heads * head_dim` floats, `scores` `total * heads * max_keys` and `out`
        // `total * heads * head_dim` (grown by the caller). Every key and value read is view
        // index `j < keys <= rows kept` of a live ring's block (see `scatter`), at slot
        // `(start + j) % rows kept`; `keys <= max_keys` bounds the scores row.
        unsafe { b.launch(cfg) }.map_err(CudaError::driver("attention"))?;
        Ok(())
    }
}
