//! Opening devices, and the device's own machinery (copies, the caching allocator, state
//! vectors). The error tests run everywhere; the others need a GPU and say SKIPPED without one.

mod common;

use amp_core::layout::Layout;
use amp_core::{Device, Error, Tensor};
use amp_cuda::Cuda;
use common::cuda_or_skip;

#[test]
fn opening_a_missing_device_is_an_error_naming_what_is_missing_never_a_panic() {
    match Cuda::new(0) {
        Ok(c) => {
            // A GPU is here: an ordinal past the last one must still be an error.
            let n = Cuda::device_count().expect("the driver answers");
            let e = Cuda::new(n + 7).expect_err("an out-of-range ordinal is an error");
            assert!(e.to_string().contains("out of range"), "{e}");
            assert_eq!(c.name(), "cuda:0");
        }
        Err(e) => {
            let Error::Device { op, device, detail } = &e else { panic!("not a device error: {e:?}") };
            assert_eq!((*op, device.as_str()), ("Cuda::new", "cuda:0"));
            let named = ["libcuda", "no CUDA device", "CUDA_ERROR", "libcublas", "libnvrtc"];
            assert!(named.iter().any(|w| detail.contains(w)), "the message names what is missing: {detail}");
            // Every ordinal fails the same way, none panics.
            assert!(Cuda::new(3).is_err());
            assert!(Cuda::available().is_err());
            println!("no GPU here, as reported: {e}");
        }
    }
}

#[test]
fn a_default_handle_opens_device_0_on_first_use_and_says_why_it_cannot() {
    let d = Cuda::default();
    assert_eq!(d.name(), "cuda:0"); // naming it touches nothing
    if Cuda::new(0).is_ok() {
        assert!(!d.device_name().is_empty());
        return;
    }
    let r = std::panic::catch_unwind(|| d.device_name());
    let msg = r.err().map(|p| p.downcast_ref::<String>().cloned().unwrap_or_default()).expect("a panic");
    assert!(msg.contains("Cuda::new(0)") && msg.contains("cuda:0"), "{msg}");
}

#[test]
fn host_round_trips_strided_views_and_fills() {
    let Some(cuda) = cuda_or_skip("host_round_trips_strided_views_and_fills") else { return };
    let x = Tensor::<f32>::from_f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let g = x.to_device(&cuda);
    assert_eq!(g.to_vec(), x.to_vec());
    assert_eq!(g.t().to_vec(), x.t().to_vec(), "a transposed view comes back in row-major order");
    assert_eq!(g.narrow(1, 1, 2).to_vec(), x.narrow(1, 1, 2).to_vec());
    let s = cuda.full(5, half::bf16::from_f32(1.5));
    assert_eq!(cuda.to_host(&s, &Layout::contiguous(&[5])), vec![half::bf16::from_f32(1.5); 5]);
    let z = cuda.full(3, 0.0f64);
    assert_eq!(cuda.to_host(&z, &Layout::contiguous(&[3])), vec![0.0; 3]);
}

#[test]
fn freed_storage_is_cached_and_reused_and_empty_cache_gives_it_back() {
    let Some(cuda) = cuda_or_skip("freed_storage_is_cached_and_reused_and_empty_cache_gives_it_back") else { return };
    cuda.empty_cache();
    let before = cuda.memory_stats();
    let a = cuda.full(1 << 20, 1.0f32); // 4 MiB
    let mid = cuda.memory_stats();
    assert!(mid.bytes_in_use >= before.bytes_in_use + (4 << 20));
    drop(a);
    let after = cuda.memory_stats();
    assert!(after.bytes_cached >= 4 << 20, "the block is cached: {after:?}");
    let b = cuda.full(1 << 20, 2.0f32);
    assert!(cuda.memory_stats().hits > after.hits, "the cached block was reused");
    drop(b);
    assert!(cuda.empty_cache() >= 4 << 20);
    assert_eq!(cuda.memory_stats().bytes_cached, 0);
}

#[test]
fn a_cloned_state_vector_is_a_copy() {
    let Some(cuda) = cuda_or_skip("a_cloned_state_vector_is_a_copy") else { return };
    let a = cuda.state_from_host(vec![1.0, 2.0, 3.0]);
    let b = a.clone();
    let mut p = cuda.from_host(vec![0.0f32; 3]);
    let g = cuda.from_host(vec![1.0f32; 3]);
    let mut m = a;
    let mut v = cuda.state_zeros(3);
    let args = amp_core::backend::AdamArgs {
        neg_step_size: -0.1,
        bias_correction2_sqrt: 1.0,
        lerp_weight: 0.5,
        beta2: 0.9,
        one_minus_beta2: 0.1,
        eps: 1e-8,
        decay: amp_core::backend::AdamDecay::None,
    };
    cuda.adam_update(&[args], &mut p, &g, &mut m, &mut v, None);
    assert_eq!(cuda.state_to_host(&b), vec![1.0, 2.0, 3.0], "the clone did not change");
    assert_ne!(cuda.state_to_host(&m), vec![1.0, 2.0, 3.0]);
    assert_eq!(cuda.state_len(&b), 3);
}

#[test]
fn ten_amp_steps_make_no_blocking_call_until_a_value_is_read() {
    use amp_core::backend::HostValue;
    use amp_core::nn::{Gpt, GptConfig};
    use amp_core::param::ToDevice;
    use amp_core::scaler::GradScaler;
    use amp_core::{Indices, Rng};
    let Some(cuda) = cuda_or_skip("ten_amp_steps_make_no_blocking_call_until_a_value_is_read") else { return };
    let config = GptConfig { vocab_size: 29, block_size: 16, d_model: 64, n_layers: 2, n_heads: 4, dropout: 0.0 };
    let mut model = Gpt::new(config, &mut Rng::seed(0)).with_fused_attention(true).unwrap().to_device(&cuda);
    let mut opt = amp_core::optim::AdamW::new(1e-3).weight_decay(0.1).build().unwrap();
    let mut scaler = GradScaler::new();
    let ids = Indices::from_vec((0..64).map(|i| (i * 7) % 29).collect(), &[4, 16]);
    let targets = Indices::from_vec((0..64).map(|i| (i * 3 + 1) % 29).collect(), &[4, 16]);
    let mut step = |model: &mut Gpt<f32, Cuda>| {
        let loss = model.loss::<half::f16>(&ids, &targets, &mut Rng::seed(1));
        let mut grads = scaler.scale(loss).backward().unscale();
        let norm = grads.clip_grad_norm(1.0);
        let report = grads.step(&mut opt, model).update().unwrap();
        (report, norm)
    };
    // Warm-up: kernels compiled, the allocator's cache filled, the optimizer's state made.
    for _ in 0..3 {
        step(&mut model);
    }
    cuda.synchronize();
    let (before, misses) = (cuda.blocking_calls(), cuda.memory_stats().misses);
    let mut last = None;
    for _ in 0..10 {
        last = Some(step(&mut model));
    }
    let during = cuda.blocking_calls() - before;
    let fresh = cuda.memory_stats().misses - misses;
    println!("blocking calls in 10 steps: {during}; fresh allocations (not blocking): {fresh}");
    assert_eq!(during, 0, "an AMP step waited for the GPU");
    let (report, norm) = last.unwrap();
    let _ = (report.skipped.get(), norm.get());
    assert!(cuda.blocking_calls() > before, "reading a value is a blocking call, counted");
}

#[test]
fn a_profile_times_each_kernel_on_the_gpu_with_one_wait_to_read_it() {
    let Some(cuda) = cuda_or_skip("a_profile_times_each_kernel_on_the_gpu_with_one_wait_to_read_it") else { return };
    let x = Tensor::<f32>::ones(&[256, 512]).to_device(&cuda).cast::<half::bf16>();
    let w = Tensor::<f32>::ones(&[128, 512]).to_device(&cuda).cast::<half::bf16>();
    let _ = x.to_vec(); // nothing queued when the profile starts
    let waits = cuda.blocking_calls();
    amp_core::profile::start();
    let y = x.linear(&w, None).gelu().softmax(1);
    let queued = cuda.blocking_calls();
    let table = amp_core::profile::stop();
    assert_eq!(queued, waits, "recording adds no wait while the work is queued");
    assert!(cuda.blocking_calls() - waits <= 1, "reading the profile waits once at most");
    let names: Vec<&str> = table.rows.iter().map(|r| r.name.as_str()).collect();
    println!("{table}");
    assert!(names.iter().any(|n| n.starts_with("gemm_bf16")), "the cuBLAS product is a row: {names:?}");
    assert!(names.iter().any(|n| n.contains("gelu")), "the GELU kernel is a row: {names:?}");
    assert!(names.iter().any(|n| n.contains("softmax")), "the softmax kernel is a row: {names:?}");
    assert!(table.rows.iter().all(|r| r.seconds > 0.0 && r.seconds.is_finite()), "{table}");
    assert!(table.kernel_seconds() <= table.wall_seconds, "{table}");
    assert_eq!(y.shape(), &[256, 128]);
}
