//! `amp_core::profile`: the CPU backend's calls land in the table under their kernel's name,
//! once each (a kernel built on another counts as the outer one), and nothing is recorded
//! outside `start`..`stop`. The profile is process-wide, so the test runs in a process of its
//! own (`crate::in_child`): tests running beside it would add their own rows.

use amp_core::{Tensor, bf16, profile};

use crate::in_child;

#[test]
fn the_cpu_backend_times_each_call_under_its_kernel_name() {
    in_child(module_path!(), "the_cpu_backend_times_each_call_under_its_kernel_name", || {
        assert!(profile::stop().rows.is_empty(), "nothing is recorded before a start");
        assert!(!profile::is_recording());

        let a = Tensor::<f32>::ones(&[32, 48]).requires_grad_();
        let b = Tensor::<f32>::ones(&[48, 16]);
        profile::start();
        assert!(profile::is_recording());
        let y = a.matmul(&b).gelu();
        let target = Tensor::<f32>::zeros(&[32, 16]);
        let loss = y.mse_loss(&target);
        let grads = loss.backward();
        let half = a.detach().cast::<bf16>();
        let table = profile::stop();
        assert!(!profile::is_recording());
        assert!(grads.get(&a).is_some() && half.dtype() == amp_core::DType::BF16);

        let calls = |name: &str| table.rows.iter().find(|r| r.name == name).map(|r| r.calls);
        assert_eq!(calls("matmul_f32"), Some(2), "the forward and a's gradient (b needs none): {table}");
        assert_eq!(calls("gelu_fwd_f32"), Some(1), "{table}");
        assert_eq!(calls("gelu_bwd_f32"), Some(1), "{table}");
        assert_eq!(calls("mse_fwd_f32"), Some(1), "{table}");
        assert_eq!(calls("mse_bwd_f32"), Some(1), "{table}");
        assert_eq!(calls("cast_to_bf16_f32"), Some(1), "{table}");
        // mse's backward runs the scaled-difference map inside its own call: counted once, as mse_bwd.
        assert_eq!(calls("scaled_diff_f32"), None, "a nested kernel is not counted twice: {table}");

        assert!(table.rows.iter().all(|r| r.seconds >= 0.0 && r.seconds.is_finite()));
        assert!(table.rows.windows(2).all(|w| w[0].seconds >= w[1].seconds), "heaviest first");
        assert!(table.kernel_seconds() <= table.wall_seconds, "{table}");
        assert_eq!(
            table.seconds_matching("matmul"),
            table.rows.iter().find(|r| r.name == "matmul_f32").unwrap().seconds
        );
        let text = table.to_string();
        assert!(text.starts_with("| kernel | calls | total ms |"), "{text}");
        assert!(text.contains("| matmul_f32 | 2 |") && text.contains("(outside any kernel)"), "{text}");

        // Stopped: ops record nothing, and a second stop returns an empty table.
        let _ = a.matmul(&b);
        assert!(profile::stop().rows.is_empty());

        // A new start begins a new table.
        profile::start();
        let _ = b.cast::<bf16>();
        let again = profile::stop();
        assert_eq!(again.rows.len(), 1, "{again}");
        assert_eq!(again.rows[0].name, "cast_to_bf16_f32");

        // Attention's copies, forward and backward: q, k and v are views of one qkv (`reshape`
        // of a narrow is a view), the products write their gradients straight into qkv's
        // gradient buffer, in its memory order (so the permute and reshape back are views too,
        // and nothing is concatenated), and the one copy left is the heads' output put back in
        // token order before the projection, as in PyTorch.
        let mut rng = amp_core::Rng::seed(1);
        let attn = amp_core::nn::CausalSelfAttention::new(16, 2, 0.0, &mut rng).with_fused(false).unwrap();
        let x = Tensor::<f32>::randn(&[2, 8, 16], &mut rng).requires_grad_();
        profile::start();
        let target = Tensor::<f32>::zeros(&[2, 8, 16]);
        let grads = attn.forward::<f32, f32>(&x, &mut rng).mse_loss(&target).backward();
        let table = profile::stop();
        assert!(grads.get(&x).is_some() && grads.get(&attn.qkv.weight).is_some());
        let calls = |name: &str| table.rows.iter().find(|r| r.name == name).map(|r| r.calls);
        assert_eq!(calls("contiguous_f32"), Some(1), "{table}");
        assert_eq!(calls("cat_f32"), None, "the q, k and v gradients are written in place: {table}");
        assert_eq!(calls("write_into_f32"), None, "by the products themselves: {table}");

        // In bf16 the scores' scale, mask, f32 softmax and cast back are one kernel each way,
        // reading and writing bf16 only: no scale, mask, softmax or cast kernel of their own.
        let attn = attn.to_precision::<bf16>();
        profile::start();
        let grads = attn.forward::<bf16, f32>(&x, &mut rng).cast::<f32>().mse_loss(&target).backward();
        let table = profile::stop();
        assert!(grads.get(&x).is_some());
        let calls = |name: &str| table.rows.iter().find(|r| r.name == name).map(|r| r.calls);
        assert_eq!(calls("scaled_masked_softmax_fwd_bf16"), Some(1), "{table}");
        assert_eq!(calls("scaled_masked_softmax_bwd_bf16"), Some(1), "{table}");
        for separate in ["mul_scalar_fwd_bf16", "select_bf16", "softmax_to_f32_fwd_bf16", "softmax_fwd_f32"] {
            assert_eq!(calls(separate), None, "{separate}: {table}");
        }

        // A layer norm whose output a bf16 layer reads writes bf16 and reads the bf16 gradient:
        // no cast kernel on either side.
        let norm = amp_core::nn::LayerNorm::new(16);
        profile::start();
        let grads = norm.forward_to::<bf16, f32>(&x).cast::<f32>().mse_loss(&target).backward();
        let table = profile::stop();
        assert!(grads.get(&x).is_some() && grads.get(&norm.weight).is_some());
        let calls = |name: &str| table.rows.iter().find(|r| r.name == name).map(|r| r.calls);
        assert_eq!(calls("layer_norm_to_bf16_fwd_f32"), Some(1), "{table}");
        assert_eq!(calls("layer_norm_to_bf16_bwd_f32"), Some(1), "{table}");
        assert_eq!(calls("layer_norm_fwd_f32"), None, "{table}");
        // The one cast each way is this test's own `cast::<f32>()` of the output for the loss.
        assert_eq!((calls("cast_to_f32_bf16"), calls("cast_to_bf16_f32")), (Some(1), Some(1)), "{table}");

        // A residual add of a bf16 branch into the f32 stream reads the branch as it is: one
        // kernel, no cast of the branch to f32 first.
        let branch = x.cast::<bf16>();
        profile::start();
        let y = x.add_cast(&branch);
        let table = profile::stop();
        assert_eq!(y.shape(), x.shape());
        let calls = |name: &str| table.rows.iter().find(|r| r.name == name).map(|r| r.calls);
        assert_eq!(calls("add_cast_bf16_f32"), Some(1), "{table}");
        assert_eq!((calls("cast_to_f32_bf16"), calls("add_f32")), (None, None), "{table}");

        // In a residual block the norm's backward adds its input gradient into the skip
        // connection's as it writes it: no separate accumulation pass.
        profile::start();
        let y = x.add_cast(&norm.forward_to::<bf16, f32>(&x));
        let grads = y.mse_loss(&target).backward();
        let table = profile::stop();
        assert!(grads.get(&x).is_some());
        let calls = |name: &str| table.rows.iter().find(|r| r.name == name).map(|r| r.calls);
        assert_eq!(calls("layer_norm_to_bf16_bwd_into_f32"), Some(1), "{table}");
        assert_eq!((calls("layer_norm_to_bf16_bwd_f32"), calls("add_into_f32")), (None, None), "{table}");
    });
}
