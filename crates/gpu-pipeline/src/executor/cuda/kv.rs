//! KV elements in device memory: the [`KvStorage`] a ring keeps on the GPU.

use std::sync::Arc;

use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, DeviceRepr, DriverError,
    LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use kv_ring::{KvDtype, KvError, KvRing, KvStorage, KvTensor, StorageOp};

use super::CudaError;

/// A ring's K/V elements in one device buffer of `f32`, blocks back to back like
/// [`kv_ring::HostKv`]: block `b` (see [`KvStorage`]) is elements
/// [`block_offset(b)`](Self::block_offset)`..block_offset(b + 1)`.
///
/// The ring does the slot arithmetic ([`kv_ring::KvRing::layer_slots`]); the executor's
/// `kv_scatter` kernel writes a layer's new rows at those slots and `attention` reads the
/// blocks in place. Only `f32` rings: an `f16` pool's allocation is
/// [`KvError::StorageFailed`]. The allocator is the stream every copy is ordered on.
#[derive(Debug)]
pub struct DeviceKv {
    /// `None` for the empty placeholder (no allocation).
    buf: Option<CudaSlice<f32>>,
    /// Block `b` is `buf[bounds[b]..bounds[b + 1]]`.
    bounds: Box<[usize]>,
    /// Staging for overlapping copies inside the buffer (sink moves of sliding rings).
    tmp: Option<CudaSlice<f32>>,
}

fn prefix_bounds(block_lens: &[usize]) -> Box<[usize]> {
    std::iter::once(0)
        .chain(block_lens.iter().scan(0usize, |end, &len| {
            *end += len;
            Some(*end)
        }))
        .collect()
}

fn failed(op: StorageOp, elems: usize) -> impl FnOnce(DriverError) -> KvError {
    move |e| KvError::StorageFailed {
        op,
        bytes: elems * size_of::<f32>(),
        reason: e.to_string(),
    }
}

impl DeviceKv {
    /// Element offset of block `block` in [`buffer`](Self::buffer) (`block` up to the block
    /// count: the end).
    pub fn block_offset(&self, block: usize) -> usize {
        self.bounds[block]
    }

    /// The device buffer (`None` only for a dropped ring's placeholder).
    pub fn buffer(&self) -> Option<&CudaSlice<f32>> {
        self.buf.as_ref()
    }

    /// The device buffer, writable.
    pub fn buffer_mut(&mut self) -> Option<&mut CudaSlice<f32>> {
        self.buf.as_mut()
    }

    fn buf_mut(&mut self) -> &mut CudaSlice<f32> {
        self.buf
            .as_mut()
            .expect("copies only happen on a live ring's storage")
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
        if dtype != KvDtype::F32 {
            return Err(KvError::StorageFailed {
                op: StorageOp::Alloc,
                bytes: elems * dtype.elem_bytes(),
                reason: format!("device KV holds f32 only, not {dtype:?}"),
            });
        }
        let buf = stream
            .alloc_zeros::<f32>(elems)
            .map_err(failed(StorageOp::Alloc, elems))?;
        Ok(Self {
            buf: Some(buf),
            bounds,
            tmp: None,
        })
    }

    fn empty(_: KvDtype) -> Self {
        Self {
            buf: None,
            bounds: Box::new([0]),
            tmp: None,
        }
    }

    /// The ring's buffer only (the staging buffer of sink moves is scratch, at most the sinks'
    /// rows of one block, and not counted).
    fn allocated_bytes(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.num_bytes())
    }

    /// A new buffer and one device-to-device copy per block.
    fn grow_blocks(
        &mut self,
        stream: &Arc<CudaStream>,
        block_lens: &[usize],
    ) -> Result<(), KvError> {
        assert_eq!(block_lens.len() + 1, self.bounds.len(), "same block count");
        let bounds = prefix_bounds(block_lens);
        let elems = bounds[bounds.len() - 1];
        let mut new = stream
            .alloc_zeros::<f32>(elems)
            .map_err(failed(StorageOp::Grow, elems))?;
        if let Some(old) = &self.buf {
            for b in 0..block_lens.len() {
                let (o, len) = (self.bounds[b], self.bounds[b + 1] - self.bounds[b]);
                if len > 0 {
                    stream
                        .memcpy_dtod(
                            &old.slice(o..o + len),
                            &mut new.slice_mut(bounds[b]..bounds[b] + len),
                        )
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
        let base = self.bounds[block];
        debug_assert!(base + src.max(dst) + len <= self.bounds[block + 1]);
        let stream = self.buf_mut().stream().clone();
        if self.tmp.as_ref().is_none_or(|t| t.len() < len) {
            self.tmp = Some(
                stream
                    .alloc_zeros::<f32>(len)
                    .map_err(failed(StorageOp::Copy, len))?,
            );
        }
        let tmp = self.tmp.as_mut().expect("allocated above");
        let buf = self.buf.as_mut().expect("live ring");
        stream
            .memcpy_dtod(
                &buf.slice(base + src..base + src + len),
                &mut tmp.slice_mut(0..len),
            )
            .map_err(failed(StorageOp::Copy, len))?;
        stream
            .memcpy_dtod(
                &tmp.slice(0..len),
                &mut buf.slice_mut(base + dst..base + dst + len),
            )
            .map_err(failed(StorageOp::Copy, len))
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
        let (to, from) = (self.bounds[block] + dst, other.bounds[src_block] + src);
        let other_buf = other.buf.as_ref().expect("a live ring's storage");
        let buf = self.buf_mut();
        let stream = buf.stream().clone();
        stream
            .memcpy_dtod(
                &other_buf.slice(from..from + len),
                &mut buf.slice_mut(to..to + len),
            )
            .map_err(failed(StorageOp::Copy, len))
    }
}

/// Writes a layer's new K/V rows, already on the device, into a [`DeviceKv`] ring with the
/// `kv_scatter` kernel: what [`KvRing::write_layer`] does for a host ring. Owns its small index
/// buffers (grown, never shrunk), so a decode step allocates nothing once they fit.
pub struct KvScatter {
    kernel: CudaFunction,
    slots_h: Vec<u32>,
    offs_h: Vec<u64>,
    slots_d: Option<CudaSlice<u32>>,
    offs_d: Option<CudaSlice<u64>>,
}

impl std::fmt::Debug for KvScatter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvScatter").finish_non_exhaustive()
    }
}

fn u32_of(value: usize, bytes: usize) -> Result<u32, KvError> {
    u32::try_from(value).map_err(|_| KvError::StorageFailed {
        op: StorageOp::Write,
        bytes,
        reason: format!("{value} does not fit the kernel's 32-bit sizes"),
    })
}

/// Copies `host` to the start of `*buf`, reallocating it when too small.
fn upload<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    host: &[T],
    buf: &mut Option<CudaSlice<T>>,
) -> Result<(), KvError> {
    let bytes = size_of_val(host);
    let fail = |e: DriverError| KvError::StorageFailed {
        op: StorageOp::Write,
        bytes,
        reason: e.to_string(),
    };
    if buf.as_ref().is_none_or(|b| b.len() < host.len()) {
        *buf = Some(stream.alloc_zeros(host.len()).map_err(fail)?);
    }
    let dst = buf.as_mut().expect("allocated above");
    stream
        .memcpy_htod(host, &mut dst.slice_mut(0..host.len()))
        .map_err(fail)
}

impl KvScatter {
    /// Loads `kv_scatter` from the kernels' module ([`super::kernels::SOURCE`]).
    pub fn new(module: &Arc<CudaModule>) -> Result<Self, CudaError> {
        Ok(Self {
            kernel: module
                .load_function("kv_scatter")
                .map_err(CudaError::driver("load kv_scatter"))?,
            slots_h: Vec::new(),
            offs_h: Vec::new(),
            slots_d: None,
            offs_d: None,
        })
    }

    /// Writes the pending tokens' rows of `layer`: `k` and `v` are `[pending][n_kv_heads]
    /// [head_dim]` `f32` on the device (on the pool's stream), then marks the layer written
    /// ([`KvRing::mark_layer_written`]).
    ///
    /// Errors: [`KvError::NoPendingChunk`], [`KvError::LayerOutOfRange`],
    /// [`KvError::SliceLength`], [`KvError::StorageFailed`] (a driver error).
    pub fn write_layer(
        &mut self,
        ring: &mut KvRing<DeviceKv>,
        layer: usize,
        k: &CudaView<'_, f32>,
        v: &CudaView<'_, f32>,
    ) -> Result<(), KvError> {
        let slots = ring.layer_slots(layer)?;
        let shape = ring.pool().shape();
        let (heads, hd, n) = (shape.n_kv_heads, shape.head_dim, ring.pending());
        let expected = n * heads * hd;
        for (tensor, s) in [(KvTensor::K, k), (KvTensor::V, v)] {
            if s.len() != expected {
                return Err(KvError::SliceLength {
                    tensor,
                    expected,
                    actual: s.len(),
                });
            }
        }
        if n > 0 {
            let stream = Arc::clone(ring.pool().allocator());
            self.slots_h.clear();
            for i in 0..n {
                self.slots_h
                    .push(u32_of(slots.slot(slots.committed + i), expected * 4)?);
            }
            self.offs_h.clear();
            for tensor in [KvTensor::K, KvTensor::V] {
                for g in 0..heads {
                    let b = ring.block_index(layer, g, tensor);
                    self.offs_h.push(ring.storage().block_offset(b) as u64);
                }
            }
            upload(&stream, &self.slots_h, &mut self.slots_d)?;
            upload(&stream, &self.offs_h, &mut self.offs_d)?;
            let (slots_d, offs_d) = (
                self.slots_d.as_ref().expect("uploaded"),
                self.offs_d.as_ref().expect("uploaded"),
            );
            let (heads32, hd32) = (u32_of(heads, 0)?, u32_of(hd, 0)?);
            let grid = u32_of(n * heads, 0)?;
            let dst = ring
                .storage_mut()
                .buffer_mut()
                .expect("a live ring has its buffer");
            for (t, src) in [k, v].into_iter().enumerate() {
                let offs = offs_d.slice(t * heads..(t + 1) * heads);
                let mut b = stream.launch_builder(&self.kernel);
                b.arg(src)
                    .arg(&heads32)
                    .arg(&hd32)
                    .arg(&offs)
                    .arg(slots_d)
                    .arg(&mut *dst);
                let cfg = LaunchConfig {
                    grid_dim: (grid, 1, 1),
                    block_dim: (hd32.min(256), 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: the arguments match `kv_scatter(const float*, u32, u32, const u64*,
                // const u32*, float*)`; `src` holds `n * heads * hd` floats (checked above);
                // `offs` holds `heads` block offsets and `slots_d` `n` slots below the layer's
                // rows kept, so every row written, `block_off[g] + slot * hd .. + hd`, lies
                // inside block g of `dst` (the ring's layout, `DeviceKv::block_offset`).
                unsafe { b.launch(cfg) }.map_err(|e| KvError::StorageFailed {
                    op: StorageOp::Write,
                    bytes: expected * 4,
                    reason: e.to_string(),
                })?;
            }
        }
        ring.mark_layer_written(layer)
    }
}
