//! Block table, profile file, warm-up, residency (mincore) and budget, with real page-cache
//! residency on a private synthetic model file (so no other process maps it).

use std::sync::Arc;
use std::time::Duration;

use weight_cache::{
    AccessProfile, BlockTable, BlockTableError, CacheConfig, GgmlType, Gguf, GgufBuilder,
    ProfileError, WarmupStrategy, WeightCache, locate_default_model,
};

const MIB: usize = 1 << 20;

/// A 24-layer synthetic model of ~24 MiB: norms, an embedding, one 1 MiB matrix per layer.
fn synthetic(dir: &std::path::Path) -> Arc<Gguf> {
    let mut b = GgufBuilder::new()
        .kv_str("general.architecture", "llama")
        .tensor(
            "token_embd.weight",
            GgmlType::F32,
            &[256, 1024],
            vec![1; MIB],
        );
    for l in 0..22 {
        b = b
            .tensor(
                &format!("blk.{l}.attn_norm.weight"),
                GgmlType::F32,
                &[64],
                vec![2; 256],
            )
            .tensor(
                &format!("blk.{l}.ffn_up.weight"),
                GgmlType::F32,
                &[256, 1024],
                vec![3; MIB],
            );
    }
    b = b.tensor("output_norm.weight", GgmlType::F32, &[64], vec![4; 256]);
    let path = dir.join("synthetic.gguf");
    std::fs::write(&path, b.build()).unwrap();
    // Written pages are dirty until synced, and dirty pages cannot be dropped from the page cache.
    std::fs::File::open(&path).unwrap().sync_all().unwrap();
    // SAFETY: the test owns the file and does not modify it while mapped.
    Arc::new(unsafe { Gguf::open(&path) }.unwrap())
}

#[test]
fn block_table_maps_tensors_and_back_on_the_default_model() {
    let path = locate_default_model().unwrap_or_else(|e| panic!("{e}"));
    // SAFETY: tests never modify the model file.
    let g = unsafe { Gguf::open(&path) }.unwrap();
    assert!(matches!(
        BlockTable::new(&g, 3000),
        Err(BlockTableError::BadBlockSize {
            block_size: 3000,
            ..
        })
    ));
    assert!(BlockTable::new(&g, 1024).is_err(), "below the page size");
    for bs in [64 * 1024, 1 << 20] {
        let t = BlockTable::new(&g, bs).unwrap();
        assert_eq!(t.n_blocks(), g.bytes().len().div_ceil(bs));
        let mut covered = vec![0usize; t.n_blocks()];
        for v in g.tensors() {
            let blocks = t.tensor_blocks(v.index);
            assert_eq!(blocks.start, v.offset as usize / bs);
            assert_eq!(blocks.end, (v.offset as usize + v.data.len() - 1) / bs + 1);
            for b in blocks {
                assert!(
                    t.tensors_in_block(b).any(|x| x == v.index),
                    "{} in block {b}",
                    v.name
                );
                covered[b] += 1;
            }
        }
        for (b, c) in covered.iter().enumerate() {
            assert_eq!(t.tensors_in_block(b).count(), *c, "block {b}");
        }
    }
}

#[test]
fn profile_file_round_trip_and_rejects_corrupt_or_foreign() {
    let dir = tempfile::tempdir().unwrap();
    let g = synthetic(dir.path());
    let cache = WeightCache::new(g.clone(), CacheConfig::default()).unwrap();
    let r = cache.begin_request();
    cache.touch(3, r);
    cache.touch(3, r);
    cache.end_token();
    let p = cache.profile();
    assert_eq!((p.n_requests, p.n_tokens), (1, 1));
    let blocks = cache.table().tensor_blocks(3);
    assert!(
        blocks
            .clone()
            .all(|b| p.touches[b] == 2 && p.requests[b] == 1)
    );
    assert_eq!(
        p.ranked()[..blocks.len()],
        blocks.clone().collect::<Vec<_>>()[..]
    );

    let f = dir.path().join("p.prof");
    cache.save_profile(&f).unwrap();
    assert_eq!(AccessProfile::load(&f).unwrap(), p);
    let enc = p.encode();
    let mut bad = enc.clone();
    bad[60] ^= 1;
    assert!(matches!(
        AccessProfile::decode(&bad),
        Err(ProfileError::Checksum { .. })
    ));
    assert!(matches!(
        AccessProfile::decode(&enc[..enc.len() - 1]),
        Err(ProfileError::LengthMismatch { .. })
    ));
    assert!(matches!(
        AccessProfile::decode(b"nope"),
        Err(ProfileError::BadMagic)
    ));
    let mut v2 = enc.clone();
    v2[8] = 2;
    assert!(matches!(
        AccessProfile::decode(&v2),
        Err(ProfileError::UnsupportedVersion { version: 2 })
    ));
    let mut huge = enc[..52].to_vec();
    huge[44..52].copy_from_slice(&u64::MAX.to_le_bytes());
    huge.extend([0; 4]);
    assert!(matches!(
        AccessProfile::decode(&huge),
        Err(ProfileError::LengthMismatch { .. })
    ));

    // A fresh cache loads it and adds to it; a corrupt one or another model's is ignored.
    let c2 = WeightCache::new(g.clone(), CacheConfig::default()).unwrap();
    c2.load_profile(&f).unwrap();
    assert_eq!(c2.profile(), p);
    std::fs::write(&f, &bad).unwrap();
    let c3 = WeightCache::new(g.clone(), CacheConfig::default()).unwrap();
    assert!(c3.load_profile(&f).is_err());
    assert_eq!(c3.profile().n_requests, 0);
    let other = WeightCache::new(g, CacheConfig::default().block_size(128 * 1024)).unwrap();
    std::fs::write(&f, &enc).unwrap();
    assert!(matches!(
        other.load_profile(&f),
        Err(ProfileError::Foreign { .. })
    ));
}

#[test]
fn static_heuristic_warms_norms_embeddings_then_first_layers() {
    let dir = tempfile::tempdir().unwrap();
    let g = synthetic(dir.path());
    let cache = WeightCache::new(g.clone(), CacheConfig::default()).unwrap();
    let plan = cache.plan(WarmupStrategy::deterministic());
    let n = cache.table().n_blocks();
    assert_eq!(plan.len(), (0.23 * n as f64).ceil() as usize);
    assert_eq!(
        plan,
        cache.plan(WarmupStrategy::deterministic()),
        "deterministic"
    );
    let t = cache.table();
    let first_norm = t.tensor_blocks(g.tensor_index("blk.0.attn_norm.weight").unwrap());
    assert_eq!(plan[0], first_norm.start);
    let emb = t.tensor_blocks(g.tensor_index("token_embd.weight").unwrap());
    assert!(emb.clone().all(|b| plan.contains(&b)));
    let l0 = t.tensor_blocks(g.tensor_index("blk.0.ffn_up.weight").unwrap());
    assert!(l0.clone().all(|b| plan.contains(&b)));
    let last = t.tensor_blocks(g.tensor_index("blk.21.ffn_up.weight").unwrap());
    // Only the edge blocks shared with norms are planned for the last layer's matrix.
    assert!((last.start + 1..last.end - 1).all(|b| !plan.contains(&b)));
    assert_eq!(cache.plan(WarmupStrategy::Full).len(), n);
    assert!(cache.plan(WarmupStrategy::None).is_empty());
}

#[cfg(target_os = "linux")]
#[test]
fn profile_warmup_budget_cycle_with_real_residency() {
    let dir = tempfile::tempdir().unwrap();
    let g = synthetic(dir.path());
    let file = g.bytes().len();
    let cfg = CacheConfig::default().budget_bytes(Some(4 * MIB));
    let cache = WeightCache::new(g.clone(), cfg).unwrap();

    // Cold start: a request touching layers 5..8 finds nothing resident.
    cache.make_cold().unwrap();
    let cold = cache.resident_bytes().unwrap();
    assert!(cold < MIB, "cold file still has {cold} resident bytes");
    let hot: Vec<usize> = (5..8)
        .map(|l| g.tensor_index(&format!("blk.{l}.ffn_up.weight")).unwrap())
        .collect();
    let r = cache.begin_request();
    for &t in &hot {
        cache.touch(t, r);
    }
    cache.end_token();
    let s = cache.stats();
    assert_eq!(s.first_touch_hit_rate, Some(0.0));
    println!("cold: {s:?}");

    // Profile, make cold again, deterministic warm-up from the profile.
    let prof = dir.path().join("p.prof");
    cache.save_profile(&prof).unwrap();
    let c2 = WeightCache::new(
        g.clone(),
        CacheConfig::default().budget_bytes(Some(4 * MIB)),
    )
    .unwrap();
    c2.load_profile(&prof).unwrap();
    c2.make_cold().unwrap();
    let cold = c2.resident_bytes().unwrap();
    assert!(cold < MIB, "cold file still has {cold} resident bytes");
    let plan = c2.plan(WarmupStrategy::Deterministic {
        fraction: 0.2,
        mlock: false,
    });
    let h = c2.warm(WarmupStrategy::Deterministic {
        fraction: 0.2,
        mlock: false,
    });
    let p = h.wait();
    assert!(p.is_finished());
    assert_eq!(p.done_blocks(), plan.len());
    for &t in &hot {
        assert_eq!(
            c2.tensor_resident_bytes(t).unwrap(),
            g.tensor_at(t).unwrap().data.len()
        );
    }
    // What was warmed and nothing more: no read-ahead around the planned blocks, and no
    // read-ahead left in flight by the header reads of `WeightCache::new` landing after
    // `make_cold` (on a disk with an 8 MiB `read_ahead_kb` that put 15 MiB resident here).
    let warm_resident = c2.resident_bytes().unwrap();
    let planned = plan.len() * 64 * 1024;
    assert!(
        warm_resident >= 3 * MIB && warm_resident <= planned + 256 * 1024,
        "{warm_resident} resident after warming {planned} bytes"
    );
    let r = c2.begin_request();
    for &t in &hot {
        c2.touch(t, r);
    }
    let s = c2.stats();
    assert_eq!(s.first_touch_hit_rate, Some(1.0));
    assert_eq!(s.blocks_warmed, plan.len() as u64);
    println!("warmed: {s:?}");

    // Full warm-up, then the budget releases the coldest blocks and residency really drops.
    c2.warm(WarmupStrategy::Full).wait();
    let before = c2.resident_bytes().unwrap();
    assert!(before >= file - 64 * 1024, "{before} of {file}");
    let rep = c2.enforce_budget().unwrap();
    let after = c2.resident_bytes().unwrap();
    println!("budget: {rep:?}, resident now {after}");
    assert_eq!(rep.resident_before, before);
    assert!(
        after <= 4 * MIB + 256 * 1024,
        "resident {after} over budget"
    );
    assert!(after < before / 4);
    // The hottest tensors (from the profile) stayed.
    for &t in &hot[..1] {
        assert!(c2.tensor_resident_bytes(t).unwrap() > 0);
    }
}

/// The budget is a soft target: `enforce_budget` brings residency under it, but one pass that
/// reads every weight (what a decode step of a dense model does) brings it back to the tensor
/// data, the working-set floor.
#[cfg(target_os = "linux")]
#[test]
fn a_budget_below_the_working_set_holds_only_until_the_next_pass_over_the_weights() {
    let dir = tempfile::tempdir().unwrap();
    let g = synthetic(dir.path());
    let cache = WeightCache::new(
        g.clone(),
        CacheConfig::default().budget_bytes(Some(4 * MIB)),
    )
    .unwrap();
    let working_set = cache.tensor_data_bytes();
    let expected: usize = g.tensors().map(|t| t.data.len()).sum();
    assert_eq!(working_set, expected);
    assert!(working_set > 20 * MIB, "{working_set}");

    cache.warm(WarmupStrategy::Full).wait();
    cache.enforce_budget().unwrap();
    let enforced = cache.resident_bytes().unwrap();
    assert!(enforced <= 4 * MIB + 256 * 1024, "{enforced}");

    // One "decode step": read one byte per page of every tensor.
    let mut acc = 0u8;
    for t in g.tensors() {
        for b in t.data.iter().step_by(4096) {
            acc = acc.wrapping_add(*b);
        }
    }
    std::hint::black_box(acc);
    let after_step = cache.resident_bytes().unwrap();
    println!(
        "budget 4 MiB: {enforced} resident after enforce_budget, {after_step} after one pass \
         (tensor data {working_set})"
    );
    assert!(after_step >= working_set, "{after_step} < {working_set}");
}

#[cfg(target_os = "linux")]
#[test]
fn adaptive_warmup_learns_from_live_touches() {
    let dir = tempfile::tempdir().unwrap();
    let g = synthetic(dir.path());
    let cache = WeightCache::new(g.clone(), CacheConfig::default()).unwrap();
    cache.make_cold().unwrap();
    let t = g.tensor_index("blk.20.ffn_up.weight").unwrap();
    let h = cache.warm(WarmupStrategy::Adaptive {
        fraction: 0.05,
        interval: Duration::from_millis(10),
    });
    let r = cache.begin_request();
    cache.touch(t, r);
    let len = g.tensor_at(t).unwrap().data.len();
    let mut ok = false;
    for _ in 0..500 {
        if cache.tensor_resident_bytes(t).unwrap() == len {
            ok = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    h.cancel();
    let p = h.wait();
    assert!(
        ok,
        "adaptive warm-up did not make the touched tensor resident"
    );
    assert!(p.done_blocks() > 0);
}
