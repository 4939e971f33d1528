//! Weight streaming under a device budget: which tensors stay resident, which stream.
//!
//! The planner is device-agnostic and sans-IO: it takes the weights' sizes grouped by layer (and
//! per expert for MoE), an optional access profile (weight-cache's hot-block profile) and a device
//! budget, and returns a [`StreamPlan`]: an arena layout with the resident tensors at fixed
//! offsets and two equal *slots* that the streamed tensors of consecutive layers alternate
//! between (double buffering: the upload of layer `i + 1` into one slot overlaps the compute of
//! layer `i` out of the other). An executor (host arena, CUDA buffer) carries the plan out.
//!
//! Policy, in order:
//! 1. Global tensors (embeddings, output head, final norm) are always resident: every step
//!    reads them.
//! 2. If everything fits, everything is resident and nothing streams.
//! 3. Otherwise per-layer tensors become resident hottest first (heat = profile touches per
//!    byte, so a small hot tensor beats a large lukewarm one; without a profile all are equal
//!    and earlier tensors win). The slot size trades against residency (a smaller slot needs
//!    every layer to keep more resident), so the planner tries each achievable slot size and
//!    keeps the plan that uploads the fewest bytes per step within the budget.
//!
//! The minimum working set is the global tensors plus two slots holding a whole layer each;
//! a smaller budget is a [`PlanError::BudgetTooSmall`] naming both sizes.
//!
//! ```
//! use gpu_pipeline::executor::{LayerWeights, PlanOptions, StreamPlan, WeightSpan};
//!
//! // Two global tensors and 4 layers of two tensors each (sizes in bytes).
//! let global = vec![WeightSpan::new(0, 0, 1000), WeightSpan::new(1, 1000, 10)];
//! let layers: Vec<LayerWeights> = (0..4)
//!     .map(|l| LayerWeights {
//!         tensors: vec![
//!             WeightSpan::new(2 + 2 * l, 2000 + 700 * l as u64, 600),
//!             WeightSpan::new(3 + 2 * l, 2600 + 700 * l as u64, 100),
//!         ],
//!     })
//!     .collect();
//! let opts = PlanOptions { align: 1, profile: None };
//! // 100%: nothing streams.
//! let all = StreamPlan::new(&global, &layers, 3810, &opts)?;
//! assert_eq!(all.streamed_bytes(), 0);
//! // The minimum: globals + two slots of one layer.
//! let min = StreamPlan::new(&global, &layers, 1010 + 2 * 700, &opts)?;
//! assert_eq!(min.slot_bytes(), 700);
//! assert!(min.arena_bytes() <= 1010 + 2 * 700);
//! assert!(StreamPlan::new(&global, &layers, 2000, &opts).is_err());
//! # Ok::<(), gpu_pipeline::executor::PlanError>(())
//! ```

use weight_cache::AccessProfile;

/// One tensor's bytes in the weight file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightSpan {
    /// The caller's id for the tensor (its index in the file, say); the plan reports ids back.
    pub id: usize,
    /// Byte offset in the weight file (used to look the tensor's blocks up in a profile).
    pub offset: u64,
    /// Length in bytes.
    pub bytes: u64,
    /// The expert this tensor belongs to (MoE), if any.
    pub expert: Option<u32>,
}

impl WeightSpan {
    /// A dense (non-expert) tensor.
    pub fn new(id: usize, offset: u64, bytes: u64) -> Self {
        Self {
            id,
            offset,
            bytes,
            expert: None,
        }
    }
}

/// The tensors one transformer layer reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LayerWeights {
    /// The layer's tensors (for MoE, each expert's tensors separately, with `expert` set).
    pub tensors: Vec<WeightSpan>,
}

/// Planner settings.
#[derive(Clone, Copy, Debug)]
pub struct PlanOptions<'a> {
    /// Alignment of every tensor in the arena (a power of two; 256 for CUDA, 64 on the CPU).
    pub align: u64,
    /// Access counts per file block; `None` treats all tensors as equally hot.
    pub profile: Option<&'a AccessProfile>,
}

impl Default for PlanOptions<'_> {
    fn default() -> Self {
        Self {
            align: 64,
            profile: None,
        }
    }
}

/// Why a plan could not be made.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum PlanError {
    /// The budget cannot hold the minimum working set: the global tensors plus two slots of
    /// the largest layer.
    #[error(
        "device budget of {budget} bytes is below the minimum working set of {minimum} bytes \
         (resident global tensors {resident} bytes + two layer slots of {slot} bytes each)"
    )]
    BudgetTooSmall {
        /// The budget given.
        budget: u64,
        /// The smallest budget that works.
        minimum: u64,
        /// The always-resident global tensors' bytes (aligned).
        resident: u64,
        /// One slot: the largest layer's bytes (aligned).
        slot: u64,
    },
    /// `align` is not a power of two.
    #[error("arena alignment {align} is not a power of two")]
    BadAlignment {
        /// The alignment given.
        align: u64,
    },
    /// The sizes overflow a `u64`.
    #[error("tensor sizes overflow 64 bits")]
    Overflow,
}

/// Where a tensor lives in the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Copied once, at this arena offset.
    Resident {
        /// Byte offset in the arena.
        offset: u64,
    },
    /// Uploaded per step into the layer's slot, at this offset from the slot's start.
    Streamed {
        /// Byte offset inside the slot.
        offset: u64,
    },
}

/// One tensor's placement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placed {
    /// The tensor.
    pub span: WeightSpan,
    /// Where it is.
    pub placement: Placement,
}

/// A layer's tensors with their placement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerPlan {
    /// The tensors, in the order given.
    pub tensors: Vec<Placed>,
    /// Bytes uploaded for this layer per step (aligned; at most [`StreamPlan::slot_bytes`]).
    pub streamed_bytes: u64,
}

/// The result of planning: an arena layout (see [`StreamPlan::new`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamPlan {
    global: Vec<Placed>,
    layers: Vec<LayerPlan>,
    resident_bytes: u64,
    slot_bytes: u64,
    total_bytes: u64,
}

fn align_up(x: u64, align: u64) -> Result<u64, PlanError> {
    x.checked_add(align - 1)
        .map(|v| v & !(align - 1))
        .ok_or(PlanError::Overflow)
}

/// Sum of aligned sizes.
fn aligned_sum<'a>(
    spans: impl IntoIterator<Item = &'a WeightSpan>,
    align: u64,
) -> Result<u64, PlanError> {
    spans.into_iter().try_fold(0u64, |acc, s| {
        acc.checked_add(align_up(s.bytes, align)?)
            .ok_or(PlanError::Overflow)
    })
}

/// Profile touches per byte of a tensor (0 when it is outside the profiled file).
fn heat(span: &WeightSpan, profile: Option<&AccessProfile>) -> f64 {
    let Some(p) = profile else { return 0.0 };
    let block = u64::from(p.block_size.max(1));
    if span.bytes == 0 {
        return 0.0;
    }
    let first = span.offset / block;
    let last = (span.offset.saturating_add(span.bytes) - 1) / block;
    let touches: u64 = (first..=last)
        .filter_map(|b| usize::try_from(b).ok())
        .filter_map(|b| p.touches.get(b))
        .fold(0u64, |a, &t| a.saturating_add(t));
    touches as f64 / span.bytes as f64
}

impl StreamPlan {
    /// Plans `global` (always resident) and `layers` into an arena of at most `budget` bytes.
    pub fn new(
        global: &[WeightSpan],
        layers: &[LayerWeights],
        budget: u64,
        opts: &PlanOptions<'_>,
    ) -> Result<Self, PlanError> {
        let align = opts.align;
        if align == 0 || !align.is_power_of_two() {
            return Err(PlanError::BadAlignment { align });
        }
        let global_bytes = aligned_sum(global, align)?;
        let layer_bytes: Vec<u64> = layers
            .iter()
            .map(|l| aligned_sum(&l.tensors, align))
            .collect::<Result<_, _>>()?;
        let total = layer_bytes
            .iter()
            .try_fold(global_bytes, |a, &b| a.checked_add(b))
            .ok_or(PlanError::Overflow)?;
        let slot = layer_bytes.iter().copied().max().unwrap_or(0);
        let minimum = slot
            .checked_mul(2)
            .and_then(|s| s.checked_add(global_bytes))
            .ok_or(PlanError::Overflow)?;
        // Resident flags per (layer, tensor).
        let mut resident: Vec<Vec<bool>> = layers
            .iter()
            .map(|l| vec![false; l.tensors.len()])
            .collect();
        if total <= budget {
            resident.iter_mut().for_each(|r| r.fill(true));
        } else if minimum > budget {
            return Err(PlanError::BudgetTooSmall {
                budget,
                minimum,
                resident: global_bytes,
                slot,
            });
        } else {
            Self::promote(layers, &mut resident, global_bytes, budget, opts)?;
        }
        Self::layout(global, layers, &resident, align)
    }

    /// Chooses the resident per-layer tensors: for each candidate slot size `S` (the streamed
    /// bytes a layer is left with after making its hottest tensors resident), every layer makes
    /// its hottest tensors resident until it streams at most `S`; the room left in the budget
    /// then takes the hottest remaining tensors. The candidate that streams the fewest bytes per
    /// step wins (ties: the larger slot, which was tried first).
    fn promote(
        layers: &[LayerWeights],
        resident: &mut [Vec<bool>],
        global_bytes: u64,
        budget: u64,
        opts: &PlanOptions<'_>,
    ) -> Result<(), PlanError> {
        let align = opts.align;
        let sizes: Vec<Vec<u64>> = layers
            .iter()
            .map(|l| l.tensors.iter().map(|s| align_up(s.bytes, align)).collect())
            .collect::<Result<_, _>>()?;
        let heats: Vec<Vec<f64>> = layers
            .iter()
            .map(|l| l.tensors.iter().map(|s| heat(s, opts.profile)).collect())
            .collect();
        // Per layer: tensor indices hottest first (stable: ties keep the file order).
        let order: Vec<Vec<usize>> = heats
            .iter()
            .map(|h| {
                let mut o: Vec<usize> = (0..h.len()).collect();
                o.sort_by(|&a, &b| h[b].total_cmp(&h[a]));
                o
            })
            .collect();
        // Candidate slot sizes: every layer's streamed bytes after promoting its k hottest.
        let mut slots: Vec<u64> = Vec::new();
        for (o, sz) in order.iter().zip(&sizes) {
            let mut left: u64 = sz.iter().sum();
            slots.push(left);
            for &t in o {
                left -= sz[t];
                slots.push(left);
            }
        }
        slots.sort_unstable_by(|a, b| b.cmp(a));
        slots.dedup();
        // Every tensor, hottest first across layers (ties: layer order), for filling spare room.
        let mut global_order: Vec<(usize, usize)> = order
            .iter()
            .enumerate()
            .flat_map(|(l, o)| o.iter().map(move |&t| (l, t)))
            .collect();
        global_order.sort_by(|a, b| heats[b.0][b.1].total_cmp(&heats[a.0][a.1]));
        let mut best: Option<(u64, Vec<Vec<bool>>)> = None;
        for slot in slots {
            let mut flags: Vec<Vec<bool>> = sizes.iter().map(|s| vec![false; s.len()]).collect();
            let mut used = global_bytes;
            let mut streamed = 0u64;
            for (l, o) in order.iter().enumerate() {
                let mut left: u64 = sizes[l].iter().sum();
                for &t in o {
                    if left <= slot {
                        break;
                    }
                    left -= sizes[l][t];
                    used += sizes[l][t];
                    flags[l][t] = true;
                }
                streamed += left;
            }
            let Some(room) = slot
                .checked_mul(2)
                .and_then(|s| s.checked_add(used))
                .and_then(|need| budget.checked_sub(need))
            else {
                continue;
            };
            let mut room = room;
            for &(l, t) in &global_order {
                if !flags[l][t] && sizes[l][t] <= room {
                    room -= sizes[l][t];
                    streamed -= sizes[l][t];
                    flags[l][t] = true;
                }
            }
            if best.as_ref().is_none_or(|(b, _)| streamed < *b) {
                best = Some((streamed, flags));
            }
        }
        // The largest slot (a whole layer) is always feasible: the caller checked the minimum.
        if let Some((_, flags)) = best {
            resident.iter_mut().zip(flags).for_each(|(r, f)| *r = f);
        }
        Ok(())
    }

    /// Assigns arena offsets: globals, then resident layer tensors, then the two slots.
    fn layout(
        global: &[WeightSpan],
        layers: &[LayerWeights],
        resident: &[Vec<bool>],
        align: u64,
    ) -> Result<Self, PlanError> {
        let mut next = 0u64;
        let mut place = |s: &WeightSpan| -> Result<Placement, PlanError> {
            let offset = next;
            next = next
                .checked_add(align_up(s.bytes, align)?)
                .ok_or(PlanError::Overflow)?;
            Ok(Placement::Resident { offset })
        };
        let global = global
            .iter()
            .map(|s| {
                Ok(Placed {
                    span: *s,
                    placement: place(s)?,
                })
            })
            .collect::<Result<Vec<_>, PlanError>>()?;
        let mut plans = Vec::with_capacity(layers.len());
        for (lw, flags) in layers.iter().zip(resident) {
            let mut in_slot = 0u64;
            let mut tensors = Vec::with_capacity(lw.tensors.len());
            for (s, &res) in lw.tensors.iter().zip(flags) {
                let placement = if res {
                    place(s)?
                } else {
                    let offset = in_slot;
                    in_slot += align_up(s.bytes, align)?;
                    Placement::Streamed { offset }
                };
                tensors.push(Placed {
                    span: *s,
                    placement,
                });
            }
            plans.push(LayerPlan {
                tensors,
                streamed_bytes: in_slot,
            });
        }
        let resident_bytes = next;
        let slot_bytes = plans.iter().map(|p| p.streamed_bytes).max().unwrap_or(0);
        let total_bytes = resident_bytes
            .checked_add(slot_bytes.checked_mul(2).ok_or(PlanError::Overflow)?)
            .ok_or(PlanError::Overflow)?;
        Ok(Self {
            global,
            layers: plans,
            resident_bytes,
            slot_bytes,
            total_bytes,
        })
    }

    /// The global tensors (all resident).
    pub fn global(&self) -> &[Placed] {
        &self.global
    }

    /// Per-layer placements.
    pub fn layers(&self) -> &[LayerPlan] {
        &self.layers
    }

    /// Bytes of resident tensors (globals and resident layer tensors), aligned.
    pub fn resident_bytes(&self) -> u64 {
        self.resident_bytes
    }

    /// Bytes of one of the two slots (0 when nothing streams).
    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    /// Arena offset of slot `s` (0 or 1).
    pub fn slot_offset(&self, s: usize) -> u64 {
        self.resident_bytes + (s as u64 & 1) * self.slot_bytes
    }

    /// The slot layer `layer` streams into: layers alternate, so layer `i + 1` uploads while
    /// layer `i` computes. Before uploading layer `i + 2` into the same slot, an executor waits
    /// for layer `i`'s compute to finish (the per-layer fence).
    pub fn slot_of(layer: usize) -> usize {
        layer & 1
    }

    /// Bytes the arena needs: resident bytes plus two slots. Never more than the budget.
    pub fn arena_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Bytes uploaded per forward step (all layers' streamed tensors).
    pub fn streamed_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.streamed_bytes).sum()
    }

    /// Whether any tensor streams.
    pub fn streams(&self) -> bool {
        self.slot_bytes > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn model(global: &[u64], layers: &[Vec<u64>]) -> (Vec<WeightSpan>, Vec<LayerWeights>) {
        let mut id = 0;
        let mut off = 0;
        let mut span = |b: u64| {
            let s = WeightSpan::new(id, off, b);
            id += 1;
            off += b;
            s
        };
        let g = global.iter().map(|&b| span(b)).collect();
        let l = layers
            .iter()
            .map(|l| LayerWeights {
                tensors: l.iter().map(|&b| span(b)).collect(),
            })
            .collect();
        (g, l)
    }

    fn opts() -> PlanOptions<'static> {
        PlanOptions {
            align: 1,
            profile: None,
        }
    }

    #[test]
    fn a_budget_below_the_minimum_names_both_sizes() {
        let (g, l) = model(&[100], &[vec![40, 10], vec![30, 30], vec![50, 5]]);
        let err = StreamPlan::new(&g, &l, 219, &opts()).unwrap_err();
        assert_eq!(
            err,
            PlanError::BudgetTooSmall {
                budget: 219,
                minimum: 220,
                resident: 100,
                slot: 60
            }
        );
        assert!(err.to_string().contains("219") && err.to_string().contains("220"));
        assert!(StreamPlan::new(&g, &l, 220, &opts()).is_ok());
    }

    #[test]
    fn everything_is_resident_when_it_fits() {
        let (g, l) = model(&[100], &[vec![40, 10], vec![30, 30]]);
        let p = StreamPlan::new(&g, &l, 210, &opts()).unwrap();
        assert!(!p.streams());
        assert_eq!((p.arena_bytes(), p.resident_bytes()), (210, 210));
    }

    #[test]
    fn hot_tensors_stay_resident_and_cold_experts_stream() {
        // Layer 0: a hot dense tensor and two experts, one never touched.
        let spans = vec![
            WeightSpan::new(1, 0, 64),
            WeightSpan {
                expert: Some(0),
                ..WeightSpan::new(2, 64, 64)
            },
            WeightSpan {
                expert: Some(1),
                ..WeightSpan::new(3, 128, 64)
            },
        ];
        let layer = LayerWeights { tensors: spans };
        let profile = AccessProfile {
            block_size: 64,
            file_len: 192,
            header_crc: 0,
            n_requests: 1,
            n_tokens: 1,
            touches: vec![10, 5, 0],
            requests: vec![1, 1, 0],
        };
        let o = PlanOptions {
            align: 1,
            profile: Some(&profile),
        };
        // Three layers (576 bytes); room for two slots of one cold expert and 6 hot tensors.
        let layers = vec![layer; 3];
        let p = StreamPlan::new(&[], &layers, 2 * 64 + 6 * 64, &o).unwrap();
        for l in p.layers() {
            assert!(matches!(l.tensors[0].placement, Placement::Resident { .. }));
            assert!(matches!(l.tensors[1].placement, Placement::Resident { .. }));
            assert!(matches!(
                l.tensors[2].placement,
                Placement::Streamed { offset: 0 }
            ));
        }
        assert_eq!(p.slot_bytes(), 64);
    }

    #[test]
    fn bad_alignment_is_refused() {
        let o = PlanOptions {
            align: 48,
            profile: None,
        };
        assert_eq!(
            StreamPlan::new(&[], &[], 0, &o),
            Err(PlanError::BadAlignment { align: 48 })
        );
    }

    proptest! {
        /// Any budget at or above the minimum yields a plan that fits it, places every tensor
        /// once, and keeps placements inside their region without overlap.
        #[test]
        fn plans_fit_the_budget_and_place_every_tensor_once(
            global in proptest::collection::vec(1u64..5000, 0..4),
            layers in proptest::collection::vec(proptest::collection::vec(1u64..5000, 1..6), 1..8),
            frac in 0.0f64..1.2,
            align_pow in 0u32..9,
        ) {
            let align = 1u64 << align_pow;
            let (g, l) = model(&global, &layers);
            let o = PlanOptions { align, profile: None };
            let al = |b: u64| b.div_ceil(align) * align;
            let gsum: u64 = global.iter().map(|&b| al(b)).sum();
            let lsums: Vec<u64> = layers.iter().map(|l| l.iter().map(|&b| al(b)).sum()).collect();
            let minimum = gsum + 2 * lsums.iter().max().unwrap();
            let total = gsum + lsums.iter().sum::<u64>();
            let budget = minimum + ((total.saturating_sub(minimum)) as f64 * frac) as u64;
            let p = StreamPlan::new(&g, &l, budget, &o).unwrap();
            prop_assert!(p.arena_bytes() <= budget.max(total));
            prop_assert!(p.arena_bytes() <= budget || total <= budget);
            prop_assert_eq!(p.streams(), total > budget);
            // Regions: [start, end) per resident tensor; slot-relative per streamed tensor.
            let mut resident: Vec<(u64, u64)> = Vec::new();
            for pl in p.global() {
                let Placement::Resident { offset } = pl.placement else { panic!("global streamed") };
                resident.push((offset, offset + pl.span.bytes));
            }
            let mut placed = p.global().len();
            for lp in p.layers() {
                let mut in_slot: Vec<(u64, u64)> = Vec::new();
                for pl in &lp.tensors {
                    placed += 1;
                    match pl.placement {
                        Placement::Resident { offset } => resident.push((offset, offset + pl.span.bytes)),
                        Placement::Streamed { offset } => in_slot.push((offset, offset + pl.span.bytes)),
                    }
                }
                in_slot.sort_unstable();
                prop_assert!(in_slot.windows(2).all(|w| w[0].1 <= w[1].0));
                prop_assert!(in_slot.iter().all(|r| r.1 <= p.slot_bytes() && r.0 % align == 0));
            }
            resident.sort_unstable();
            prop_assert!(resident.windows(2).all(|w| w[0].1 <= w[1].0));
            prop_assert!(resident.iter().all(|r| r.1 <= p.resident_bytes() && r.0 % align == 0));
            prop_assert_eq!(placed, global.len() + layers.iter().map(Vec::len).sum::<usize>());
        }

        /// Below the minimum working set every budget is refused.
        #[test]
        fn budgets_below_the_minimum_are_refused(
            layers in proptest::collection::vec(proptest::collection::vec(1u64..5000, 1..6), 1..8),
            short in 1u64..1000,
        ) {
            let (g, l) = model(&[7], &layers);
            let minimum = 7 + 2 * layers.iter().map(|l| l.iter().sum::<u64>()).max().unwrap();
            let total = 7 + layers.iter().flatten().sum::<u64>();
            let budget = minimum.saturating_sub(short);
            prop_assume!(budget < total);
            let is_too_small = matches!(
                StreamPlan::new(&g, &l, budget, &opts()),
                Err(PlanError::BudgetTooSmall { .. })
            );
            prop_assert!(is_too_small);
        }
    }
}
