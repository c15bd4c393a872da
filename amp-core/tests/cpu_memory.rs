//! The CPU caching allocator under a training loop: after warm-up every large buffer of a
//! step comes from the cache and what the allocator holds stays flat; the cache never
//! changes a result.
//!
//! The allocator is process-wide, so each test runs in a process of its own
//! (`crate::in_child`).

use amp_core::cpu_memory::{self, MemoryStats};
use amp_core::nn::{Gpt, GptConfig};
use amp_core::optim::{AdamW, Optim};
use amp_core::scaler::GradScaler;
use amp_core::{Indices, Precision, Rng, bf16, f16};

use crate::in_child;

/// Big enough that activations (512 tokens × 64 or more, f32 and bf16) are cached buffers.
fn config() -> GptConfig {
    GptConfig { vocab_size: 64, block_size: 64, d_model: 64, n_layers: 2, n_heads: 2, dropout: 0.1 }
}

/// Runs `steps` AMP steps (autocast precision `L`, GradScaler, clipping, AdamW) on a fresh
/// model; calls `after_step(i, stats)` after each and returns every step's loss.
fn train<L: Precision>(steps: usize, mut after_step: impl FnMut(usize, MemoryStats)) -> Vec<f32> {
    let mut rng = Rng::seed(0);
    let mut model = Gpt::new(config(), &mut rng);
    let ids = Indices::from_vec((0..8 * 64).map(|_| rng.below(64) as i64).collect(), &[8, 64]);
    let targets = Indices::from_vec((0..8 * 64).map(|_| rng.below(64) as i64).collect(), &[8, 64]);
    let mut drop_rng = Rng::seed(1);
    let mut opt: Optim<AdamW> = AdamW::default().build().expect("valid AdamW");
    let mut scaler = GradScaler::new();
    let mut losses = Vec::new();
    for i in 0..steps {
        let loss = model.loss::<L>(&ids, &targets, &mut drop_rng);
        losses.push(loss.item());
        let mut grads = scaler.scale(loss).backward().unscale();
        grads.clip_grad_norm(1.0);
        grads.step(&mut opt, &mut model).update().expect("scaler update");
        after_step(i, cpu_memory::memory_stats());
    }
    losses
}

#[test]
fn a_training_loop_reuses_its_buffers_and_holds_a_flat_amount_of_memory() {
    in_child(module_path!(), "a_training_loop_reuses_its_buffers_and_holds_a_flat_amount_of_memory", || {
        const WARM_UP: usize = 3;
        let mut seen: Vec<MemoryStats> = Vec::new();
        train::<bf16>(20, |i, s| {
            if i >= WARM_UP {
                seen.push(s);
            }
        });
        let first = seen[0];
        assert!(first.hits > 0 && first.bytes_cached > 0, "the cache is used: {first:?}");
        for s in &seen {
            // Every large buffer of a step after warm-up comes from the cache ...
            assert_eq!(s.misses, first.misses, "a step after warm-up allocated afresh: {s:?} vs {first:?}");
            // ... and what the allocator holds does not grow.
            assert_eq!(s.bytes_reserved(), first.bytes_reserved(), "{s:?} vs {first:?}");
            assert_eq!(s.bytes_in_use, first.bytes_in_use, "{s:?} vs {first:?}");
            assert!(s.peak_bytes_in_use <= first.peak_bytes_in_use.max(s.bytes_in_use));
        }
        assert!(seen.last().unwrap().hits > first.hits);
    });
}

#[test]
fn the_cache_never_changes_a_result() {
    in_child(module_path!(), "the_cache_never_changes_a_result", || {
        let cached = train::<f16>(6, |_, _| {});
        let limit = cpu_memory::cache_limit();
        cpu_memory::set_cache_limit(0);
        assert_eq!(cpu_memory::memory_stats().bytes_cached, 0, "a zero cap empties the cache");
        let uncached = train::<f16>(6, |_, s| assert_eq!(s.bytes_cached, 0));
        cpu_memory::set_cache_limit(limit);
        assert_eq!(cached, uncached, "bit-identical losses with and without the cache");

        // Emptying the cache mid-run changes nothing either, and the peak can be reset.
        let emptied = train::<f16>(6, |i, _| {
            if i == 2 {
                assert!(cpu_memory::empty_cache() > 0);
                assert_eq!(cpu_memory::memory_stats().bytes_cached, 0);
                cpu_memory::reset_peak_memory_stats();
                assert_eq!(cpu_memory::max_memory_allocated(), cpu_memory::memory_allocated());
            }
        });
        assert_eq!(cached, emptied);
        assert!(cpu_memory::memory_reserved() >= cpu_memory::memory_allocated());
    });
}
