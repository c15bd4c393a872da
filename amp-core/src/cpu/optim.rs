//! The CPU's optimizer kernels: [`crate::Device::sgd_update`] and [`crate::Device::adam_update`]
//! (and the pure-bf16 write-backs), each one fused pass over a parameter, its gradient and its
//! state, split across rayon's pool when the parameter is large. Every element is
//! independent, so the result does not depend on the split.

use half::bf16;
use rayon::prelude::*;

use super::{CHUNK, PAR_MIN};
use crate::backend::{AdamArgs, AdamDecay, SgdArgs};
use crate::rng::splitmix64;
use crate::simd::dispatch;

/// Runs `f(k, param, grad, a, b)` over matching chunks of a parameter, its gradient and up to
/// two state buffers, in parallel when the parameter is large; each chunk through
/// [`dispatch`] (pass `f` as `#[inline(always)] |k, p, g, a, b| ...`).
///
/// The kernel's scalars `k` reach `f` as an argument, not as captures: `f` is inlined into the
/// dispatched task, where a value read through a captured reference is reloaded on every
/// iteration of a loop that stores through `p` (LLVM cannot prove they do not alias), and
/// that keeps the loop scalar. An argument is a register.
fn for_chunks<K: Copy + Send + Sync>(
    param: &mut [f32],
    grad: &[f32],
    a: &mut [f32],
    b: &mut [f32],
    k: K,
    f: impl Fn(K, &mut [f32], &[f32], &mut [f32], &mut [f32]) + Sync + Send,
) {
    let n = param.len();
    debug_assert_eq!(grad.len(), n);
    // Empty state buffers stand for "no state": give each chunk an empty slice.
    let (sa, sb) = (split_state(a, n), split_state(b, n));
    if n < PAR_MIN {
        for (((p, g), a), b) in param.chunks_mut(CHUNK).zip(grad.chunks(CHUNK)).zip(sa).zip(sb) {
            dispatch(
                #[inline(always)]
                || f(k, p, g, a, b),
            );
        }
    } else {
        param.par_chunks_mut(CHUNK).zip(grad.par_chunks(CHUNK)).zip(sa).zip(sb).for_each(|(((p, g), a), b)| {
            dispatch(
                #[inline(always)]
                || f(k, p, g, a, b),
            )
        });
    }
}

/// A state buffer in chunks matching the parameter's; an empty buffer ("no state") gives an
/// empty slice per chunk.
fn split_state<T>(s: &mut [T], n: usize) -> Vec<&mut [T]> {
    if s.is_empty() {
        (0..n.div_ceil(CHUNK)).map(|_| <&mut [T]>::default()).collect()
    } else {
        s.chunks_mut(CHUNK).collect()
    }
}

/// SGD (PyTorch's `_single_tensor_sgd`).
pub(crate) fn sgd(args: &SgdArgs, param: &mut [f32], grad: &[f32], momentum_buffer: Option<&mut [f32]>) {
    let Some(buf) = momentum_buffer else {
        for_chunks(
            param,
            grad,
            &mut [],
            &mut [],
            *args,
            #[inline(always)]
            |args, p, g, _, _| {
                let SgdArgs { neg_lr, weight_decay, .. } = args;
                let (decay, wd) = (weight_decay.is_some(), weight_decay.unwrap_or(0.0));
                for (p, &g) in p.iter_mut().zip(g) {
                    // grad.add(param, alpha=wd): fmadd(param, wd, grad)
                    let g = if decay { p.mul_add(wd, g) } else { g };
                    // param.add_(grad, alpha=-lr): fmadd(grad, -lr, param)
                    *p = g.mul_add(neg_lr, *p);
                }
            },
        );
        return;
    };
    for_chunks(
        param,
        grad,
        buf,
        &mut [],
        *args,
        #[inline(always)]
        |args, p, g, buf, _| {
            let SgdArgs { neg_lr, weight_decay, momentum: m, keep, nesterov, first } = args;
            let (decay, wd) = (weight_decay.is_some(), weight_decay.unwrap_or(0.0));
            for ((p, &g), b) in p.iter_mut().zip(g).zip(buf.iter_mut()) {
                let g = if decay { p.mul_add(wd, g) } else { g };
                // First step: buf = clone(grad); then buf.mul_(momentum).add_(grad, alpha=1-dampening).
                *b = if first { g } else { g.mul_add(keep, *b * m) };
                // Nesterov: grad.add(buf, alpha=momentum); otherwise grad = buf.
                let d = if nesterov { b.mul_add(m, g) } else { *b };
                *p = d.mul_add(neg_lr, *p);
            }
        },
    );
}

/// Adam and AdamW (PyTorch's `_single_tensor_adam`).
pub(crate) fn adam(args: &AdamArgs, param: &mut [f32], grad: &[f32], exp_avg: &mut [f32], exp_avg_sq: &mut [f32]) {
    for_chunks(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        *args,
        #[inline(always)]
        |args, p, g, m, v| {
            let AdamArgs {
                neg_step_size,
                bias_correction2_sqrt: bc2_sqrt,
                lerp_weight: w,
                beta2: b2,
                one_minus_beta2,
                eps,
                decay,
            } = args;
            let (l2, wd) = match decay {
                AdamDecay::L2(wd) => (true, wd),
                _ => (false, 0.0),
            };
            let (decoupled, decay_mul) = match decay {
                AdamDecay::Decoupled(mul) => (true, mul),
                _ => (false, 1.0),
            };
            // lerp_(grad, w): PyTorch's vectorised lerp uses fmadd(w, end - start, start) for
            // |w| < 0.5, else fmadd(w - 1, end - start, end).
            let small = w.abs() < 0.5;
            for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                if decoupled {
                    // param.mul_(1 - lr * weight_decay)
                    *p *= decay_mul;
                }
                // grad.add(param, alpha=weight_decay)
                let g = if l2 { p.mul_add(wd, g) } else { g };
                let diff = g - *m;
                *m = if small { w.mul_add(diff, *m) } else { (w - 1.0).mul_add(diff, g) };
                // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1-beta2): self + (value*g)*g.
                *v = *v * b2 + one_minus_beta2 * g * g;
                // (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
                let denom = v.sqrt() / bc2_sqrt + eps;
                // param.addcdiv_(exp_avg, denom, value=-step_size): self + (value*m)/denom.
                *p += neg_step_size * *m / denom;
            }
        },
    );
}

/// Runs `f(k, offset, updated, param, comp)` over matching chunks (in parallel for large
/// parameters); `comp` is empty per chunk when `comp` is. Elements are independent, so the
/// result does not depend on the split. Each chunk runs through [`dispatch`]; the kernel's
/// scalars `k` are an argument for the reason given at [`for_chunks`].
fn for_chunks_bf16<K: Copy + Send + Sync>(
    updated: &[f32],
    param: &mut [bf16],
    comp: &mut [bf16],
    k: K,
    f: impl Fn(K, usize, &[f32], &mut [bf16], &mut [bf16]) + Sync + Send,
) {
    let n = param.len();
    debug_assert_eq!(updated.len(), n);
    let comp = split_state(comp, n);
    if n < PAR_MIN {
        for (i, ((u, p), c)) in updated.chunks(CHUNK).zip(param.chunks_mut(CHUNK)).zip(comp).enumerate() {
            dispatch(
                #[inline(always)]
                || f(k, i * CHUNK, u, p, c),
            );
        }
    } else {
        updated.par_chunks(CHUNK).zip(param.par_chunks_mut(CHUNK)).zip(comp).enumerate().for_each(
            |(i, ((u, p), c))| {
                dispatch(
                    #[inline(always)]
                    || f(k, i * CHUNK, u, p, c),
                )
            },
        );
    }
}

/// Kahan-compensated write-back (see [`Bf16Rounding::Kahan`]). `w − p` is exact in f32 when
/// the update is under the weight's magnitude (Sterbenz), and so is `p' − p`.
pub(crate) fn write_kahan(updated: &[f32], param: &mut [bf16], comp: &mut [bf16]) {
    for_chunks_bf16(
        updated,
        param,
        comp,
        (),
        #[inline(always)]
        |(), _, u, p, c| {
            for ((&w, p), c) in u.iter().zip(p.iter_mut()).zip(c.iter_mut()) {
                let old = p.to_f32();
                let y = (w - old) + c.to_f32();
                let new = bf16::from_f32(old + y);
                *c = bf16::from_f32(y - (new.to_f32() - old));
                *p = new;
            }
        },
    );
}

/// Round-to-nearest write-back.
pub(crate) fn write_nearest(updated: &[f32], param: &mut [bf16]) {
    for_chunks_bf16(
        updated,
        param,
        &mut [],
        (),
        #[inline(always)]
        |(), _, u, p, _| {
            for (&w, p) in u.iter().zip(p.iter_mut()) {
                *p = bf16::from_f32(w);
            }
        },
    );
}

/// Stochastic write-back: element `i` adds the low 16 bits of `hash(key, i)` to the f32 bit
/// pattern's magnitude and keeps the top 16 bits (a carry rounds up, into the exponent when it
/// must). inf and NaN are rounded as they are.
pub(crate) fn write_stochastic(updated: &[f32], param: &mut [bf16], key: u64) {
    for_chunks_bf16(
        updated,
        param,
        &mut [],
        key,
        #[inline(always)]
        |key, offset, u, p, _| {
            for (j, (&w, p)) in u.iter().zip(p.iter_mut()).enumerate() {
                *p = if w.is_finite() {
                    let r =
                        (splitmix64(key ^ ((offset + j) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)) & 0xFFFF) as u32;
                    // The magnitude is at most 0x7F7F_FFFF, so adding r never reaches the sign bit.
                    bf16::from_bits(((w.to_bits() + r) >> 16) as u16)
                } else {
                    bf16::from_f32(w)
                };
            }
        },
    );
}
