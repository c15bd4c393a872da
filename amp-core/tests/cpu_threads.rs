//! `cpu_threads::init`: the calling thread becomes a compute thread, ops started from it and
//! from other threads give the right results and finish, and a second call is refused.
//!
//! `init` sets up rayon's process-wide pool once, so each test runs in a child process of its
//! own (`crate::in_child`).

use std::sync::mpsc;
use std::time::Duration;

use amp_core::{Error, Tensor, cpu_threads};

use crate::in_child;

/// Sum of `exp(x)` over 2M elements: large enough that the op splits across the threads.
fn parallel_op() -> f64 {
    let x = Tensor::<f32>::full(&[1 << 21], 0.5);
    x.exp().sum_all().item() as f64
}

fn expected() -> f64 {
    (1u64 << 21) as f64 * 0.5f64.exp()
}

/// An op started on another thread finishes while this thread waits outside the pool (in a
/// channel receive, not in a parallel op): the other workers run it.
fn op_from_another_thread_finishes() {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || tx.send(parallel_op()).unwrap());
    let got = rx.recv_timeout(Duration::from_secs(60)).expect("an op on another thread never finished");
    assert!((got - expected()).abs() <= 1e-3 * expected(), "{got} against {}", expected());
}

#[test]
fn init_makes_the_caller_a_compute_thread() {
    in_child(module_path!(), "init_makes_the_caller_a_compute_thread", || {
        assert!(!cpu_threads::is_compute_thread());
        assert_eq!(cpu_threads::init(2).expect("first init"), 2);
        assert!(cpu_threads::is_compute_thread(), "init(2) leaves its caller outside the pool");
        let got = parallel_op();
        assert!((got - expected()).abs() <= 1e-3 * expected(), "{got} against {}", expected());
        op_from_another_thread_finishes();
        let err = cpu_threads::init(2).expect_err("a second init is refused");
        assert!(matches!(err, Error::State { .. }), "{err:?}");
        assert!(err.to_string().contains("first in main"), "{err}");
    });
}

/// After `init`, the other worker spins for work once ops start and stops once none has for
/// the spin window; ops started from this thread and from another give the right results
/// meanwhile. (Spinning is timed, and a loaded machine may pause this thread for longer than
/// the window, so the test looks for the spinning over a few tries rather than at one
/// instant.)
#[test]
fn the_other_workers_spin_between_ops_and_then_sleep() {
    in_child(module_path!(), "the_other_workers_spin_between_ops_and_then_sleep", || {
        let spins_after_an_op = || {
            (0..100).any(|_| {
                let _ = Tensor::<f32>::full(&[4], 1.0);
                cpu_threads::spinning_threads() == 1
            })
        };
        assert_eq!(cpu_threads::spinning_threads(), 0);
        assert_eq!(cpu_threads::init(2).expect("first init"), 2);
        assert_eq!(cpu_threads::spinning_threads(), 0, "no op has started yet");
        assert!(spins_after_an_op(), "the other worker never spun");
        for _ in 0..3 {
            let got = parallel_op();
            assert!((got - expected()).abs() <= 1e-3 * expected(), "{got} against {}", expected());
        }
        op_from_another_thread_finishes();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while cpu_threads::spinning_threads() != 0 {
            assert!(std::time::Instant::now() < deadline, "still spinning 10 s after the last op");
            std::thread::sleep(cpu_threads::SPIN_WINDOW);
        }
        // And it starts again with the next op.
        assert!(spins_after_an_op(), "the other worker did not spin again");
    });
}

/// `AMP_CPU_SPIN=off`: no worker spins.
#[test]
fn spinning_can_be_turned_off() {
    in_child(module_path!(), "spinning_can_be_turned_off", || {
        if std::env::var_os("AMP_CPU_SPIN").is_none() {
            // SAFETY: this child process runs this one test on one thread, before any other
            // thread reads the environment.
            unsafe { std::env::set_var("AMP_CPU_SPIN", "off") };
        }
        assert_eq!(cpu_threads::init(2).expect("first init"), 2);
        parallel_op();
        assert_eq!(cpu_threads::spinning_threads(), 0);
    });
}

#[test]
fn one_thread_still_serves_other_threads() {
    // With one thread the caller cannot be the pool's only worker: it would never run an op
    // another thread starts.
    in_child(module_path!(), "one_thread_still_serves_other_threads", || {
        assert_eq!(cpu_threads::init(1).expect("first init"), 1);
        assert!(!cpu_threads::is_compute_thread());
        op_from_another_thread_finishes();
        let got = parallel_op();
        assert!((got - expected()).abs() <= 1e-3 * expected(), "{got} against {}", expected());
        assert_eq!(cpu_threads::spinning_threads(), 0, "one thread: no other worker to spin");
    });
}

#[test]
fn init_after_an_op_is_refused_and_changes_nothing() {
    in_child(module_path!(), "init_after_an_op_is_refused_and_changes_nothing", || {
        let before = parallel_op(); // starts rayon's default pool
        let err = cpu_threads::init(0).expect_err("init after an op");
        assert!(err.to_string().contains("cpu_threads::init"), "{err}");
        assert!(!cpu_threads::is_compute_thread());
        assert_eq!(parallel_op(), before);
    });
}
