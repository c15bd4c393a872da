//! `Mirror`: a second device, implemented outside amp-core as `amp-cuda` implements `Cuda`.
//! It keeps its own storage type and runs each kernel by handing its buffers to the CPU
//! backend, counting every kernel call (`CALLS`) and every read of its memory by the host
//! (`host_reads`). Shared by amp-core's `second_device` tests and the trainer's tests (which
//! include this file by path), so both run on the same second device.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};

use amp_core::backend::{
    AdamArgs, AttentionSpec, BatchNormStats, Bf16Write, BinaryOp, Conv2dSpec, CrossEntropySpec, DimSplit, Lazy,
    Outcomes, Pool2dSpec, ReduceOp, Scalar, ScaleRule, SgdArgs, UnaryOp,
};
use amp_core::layout::Layout;
use amp_core::{Cpu, Device, Precision, bf16};

/// Kernel calls made on `Mirror`.
pub static CALLS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Reads of `Mirror`'s memory by the host (`to_host`, `state_to_host`) on this thread: on
    /// a GPU each of them waits for every kernel queued before it. Per thread, so tests running
    /// in parallel do not count each other's reads.
    static HOST_READS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

thread_local! {
    /// Host reads that found kernels queued since the previous read (on this thread): on a
    /// GPU these are the ones that wait for the device; a read right after another finds
    /// nothing left to wait for.
    static SYNCS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    /// Whether a kernel was called since the last host read (on this thread).
    static QUEUED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn host_read() {
    HOST_READS.with(|n| n.set(n.get() + 1));
    if QUEUED.with(|q| q.replace(false)) {
        SYNCS.with(|n| n.set(n.get() + 1));
    }
}

pub fn host_reads() -> usize {
    HOST_READS.with(|n| n.get())
}

/// Host reads on this thread that had to wait for queued kernels (see `SYNCS`).
pub fn syncs() -> usize {
    SYNCS.with(|n| n.get())
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Mirror;

/// `Mirror`'s storage: a CPU buffer behind a type of its own, so nothing but `Mirror`'s
/// methods can read it.
#[derive(Clone)]
pub struct Buf<E: Precision>(pub <Cpu as Device>::Storage<E>);

/// `Mirror`'s optimizer-state vectors: a type of their own too.
#[derive(Clone, Debug)]
pub struct StateBuf(pub Vec<f32>);

fn hit() {
    CALLS.fetch_add(1, Ordering::Relaxed);
    QUEUED.with(|q| q.set(true));
}

fn v<'a, E: Precision>((s, l): (&'a Buf<E>, &'a Layout)) -> (&'a <Cpu as Device>::Storage<E>, &'a Layout) {
    (&s.0, l)
}

impl Device for Mirror {
    type Storage<E: Precision> = Buf<E>;
    type RowStats<E: Precision> = <Cpu as Device>::RowStats<E>;

    fn name(&self) -> String {
        "mirror".into()
    }
    fn from_host<E: Precision>(&self, data: Vec<E>) -> Buf<E> {
        hit();
        Buf(Cpu.from_host(data))
    }
    fn full<E: Precision>(&self, n: usize, value: E) -> Buf<E> {
        hit();
        Buf(Cpu.full(n, value))
    }
    fn to_host<E: Precision>(&self, s: &Buf<E>, l: &Layout) -> Vec<E> {
        // A call, but not a queued kernel: the copy itself is what waits.
        CALLS.fetch_add(1, Ordering::Relaxed);
        host_read();
        Cpu.to_host(&s.0, l)
    }
    fn contiguous<E: Precision>(&self, s: &Buf<E>, l: &Layout) -> Buf<E> {
        hit();
        Buf(Cpu.contiguous(&s.0, l))
    }
    fn len<E: Precision>(s: &Buf<E>) -> usize {
        Cpu::len(&s.0)
    }
    fn is_exclusive<E: Precision>(s: &Buf<E>) -> bool {
        Cpu::is_exclusive(&s.0)
    }
    fn storage_id<E: Precision>(s: &Buf<E>) -> usize {
        Cpu::storage_id(&s.0)
    }
    fn write_into<E: Precision>(&self, dst: &mut Buf<E>, dl: &Layout, src: &Buf<E>, sl: &Layout, add: bool) {
        hit();
        Cpu.write_into(&mut dst.0, dl, &src.0, sl, add)
    }
    fn cast<E: Precision, T: Precision>(&self, s: &Buf<E>, l: &Layout) -> Buf<T> {
        hit();
        Buf(Cpu.cast::<E, T>(&s.0, l))
    }
    fn cast_into<E: Precision, T: Precision>(&self, s: &Buf<E>, l: &Layout, dst: &mut Buf<T>) {
        hit();
        Cpu.cast_into(&s.0, l, &mut dst.0)
    }
    fn unary<E: Precision, O: UnaryOp>(&self, op: O, x: &Buf<E>, l: &Layout) -> Buf<E> {
        hit();
        Buf(Cpu.unary(op, &x.0, l))
    }
    fn unary_backward<E: Precision, O: UnaryOp>(
        &self,
        op: O,
        x: (&Buf<E>, &Layout),
        y: (&Buf<E>, &Layout),
        g: (&Buf<E>, &Layout),
    ) -> Buf<E> {
        hit();
        Buf(Cpu.unary_backward(op, v(x), v(y), v(g)))
    }
    fn binary<E: Precision, O: BinaryOp>(
        &self,
        op: O,
        a: (&Buf<E>, &Layout),
        b: (&Buf<E>, &Layout),
        shape: &[usize],
    ) -> Buf<E> {
        hit();
        Buf(Cpu.binary(op, v(a), v(b), shape))
    }
    fn select<E: Precision>(
        &self,
        mask: (&[bool], &[usize]),
        a: (&Buf<E>, &Layout),
        b: (&Buf<E>, &Layout),
        shape: &[usize],
    ) -> Buf<E> {
        hit();
        Buf(Cpu.select(mask, v(a), v(b), shape))
    }
    fn reduce<E: Precision>(&self, x: &Buf<E>, l: &Layout, split: DimSplit, op: ReduceOp, scale: f64) -> Buf<E> {
        hit();
        Buf(Cpu.reduce(&x.0, l, split, op, scale))
    }
    fn arg_reduce<E: Precision>(&self, x: &Buf<E>, l: &Layout, split: DimSplit, max: bool) -> (Buf<E>, Vec<usize>) {
        hit();
        host_read(); // the indices come back to the host
        let (vals, idx) = Cpu.arg_reduce(&x.0, l, split, max);
        (Buf(vals), idx)
    }
    fn scatter_dim<E: Precision>(&self, g: &Buf<E>, l: &Layout, idx: &[usize], split: DimSplit) -> Buf<E> {
        hit();
        Buf(Cpu.scatter_dim(&g.0, l, idx, split))
    }
    fn matmul<E: Precision>(&self, a: (&Buf<E>, &Layout), b: (&Buf<E>, &Layout), batch: &[usize]) -> Buf<E> {
        hit();
        Buf(Cpu.matmul(v(a), v(b), batch))
    }
    fn linear<E: Precision>(
        &self,
        x: (&Buf<E>, &Layout),
        w: (&Buf<E>, &Layout),
        bias: Option<(&Buf<E>, &Layout)>,
    ) -> Buf<E> {
        hit();
        Buf(Cpu.linear(v(x), v(w), bias.map(v)))
    }
    fn softmax<E: Precision>(&self, x: &Buf<E>, l: &Layout, d: usize, log: bool) -> Buf<E> {
        hit();
        Buf(Cpu.softmax(&x.0, l, d, log))
    }
    fn softmax_backward<E: Precision>(
        &self,
        y: (&Buf<E>, &Layout),
        g: (&Buf<E>, &Layout),
        d: usize,
        log: bool,
    ) -> Buf<E> {
        hit();
        Buf(Cpu.softmax_backward(v(y), v(g), d, log))
    }
    fn norm<E: Precision>(
        &self,
        x: (&Buf<E>, &Layout),
        d: usize,
        weight: Option<(&Buf<E>, &Layout)>,
        bias: Option<(&Buf<E>, &Layout)>,
        eps: f64,
        rms: bool,
    ) -> (Buf<E>, Self::RowStats<E>) {
        hit();
        let (y, stats) = Cpu.norm(v(x), d, weight.map(v), bias.map(v), eps, rms);
        (Buf(y), stats)
    }
    fn norm_backward<E: Precision>(
        &self,
        x: (&Buf<E>, &Layout),
        g: (&Buf<E>, &Layout),
        d: usize,
        weight: Option<(&Buf<E>, &Layout)>,
        stats: &Self::RowStats<E>,
        needs: (bool, bool),
        rms: bool,
    ) -> (Buf<E>, Option<Buf<E>>, Option<Buf<E>>) {
        hit();
        let (gx, gw, gb) = Cpu.norm_backward(v(x), v(g), d, weight.map(v), stats, needs, rms);
        (Buf(gx), gw.map(Buf), gb.map(Buf))
    }
    fn causal_attention<E: Precision>(
        &self,
        q: (&Buf<E>, &Layout),
        k: (&Buf<E>, &Layout),
        vals: (&Buf<E>, &Layout),
        spec: AttentionSpec,
    ) -> (Buf<E>, Self::RowStats<E>) {
        hit();
        let (y, stats) = Cpu.causal_attention(v(q), v(k), v(vals), spec);
        (Buf(y), stats)
    }
    fn causal_attention_backward<E: Precision>(
        &self,
        q: (&Buf<E>, &Layout),
        k: (&Buf<E>, &Layout),
        vals: (&Buf<E>, &Layout),
        out: (&Buf<E>, &Layout),
        g: (&Buf<E>, &Layout),
        stats: &Self::RowStats<E>,
        spec: AttentionSpec,
    ) -> (Buf<E>, Buf<E>, Buf<E>) {
        hit();
        let (dq, dk, dv) = Cpu.causal_attention_backward(v(q), v(k), v(vals), v(out), v(g), stats, spec);
        (Buf(dq), Buf(dk), Buf(dv))
    }
    fn cross_entropy<E: Precision>(
        &self,
        x: (&Buf<E>, &Layout),
        c: usize,
        spec: CrossEntropySpec<'_>,
    ) -> (Buf<E>, Self::RowStats<E>, usize) {
        hit();
        let (loss, stats, n) = Cpu.cross_entropy(v(x), c, spec);
        (Buf(loss), stats, n)
    }
    fn cross_entropy_backward<E: Precision>(
        &self,
        x: (&Buf<E>, &Layout),
        c: usize,
        spec: CrossEntropySpec<'_>,
        stats: &Self::RowStats<E>,
        g: (&Buf<E>, &Layout),
        counted: usize,
    ) -> Buf<E> {
        hit();
        Buf(Cpu.cross_entropy_backward(v(x), c, spec, stats, v(g), counted))
    }
    fn mse<E: Precision>(&self, a: (&Buf<E>, &Layout), b: (&Buf<E>, &Layout)) -> Buf<E> {
        hit();
        Buf(Cpu.mse(v(a), v(b)))
    }
    fn mse_backward<E: Precision>(
        &self,
        a: (&Buf<E>, &Layout),
        b: (&Buf<E>, &Layout),
        g: (&Buf<E>, &Layout),
    ) -> Buf<E> {
        hit();
        Buf(Cpu.mse_backward(v(a), v(b), v(g)))
    }
    fn conv2d<E: Precision>(
        &self,
        x: (&Buf<E>, &Layout),
        w: (&Buf<E>, &Layout),
        bias: Option<(&Buf<E>, &Layout)>,
        spec: &Conv2dSpec,
    ) -> Buf<E> {
        hit();
        Buf(Cpu.conv2d(v(x), v(w), bias.map(v), spec))
    }
    fn conv2d_backward_input<E: Precision>(
        &self,
        g: (&Buf<E>, &Layout),
        w: (&Buf<E>, &Layout),
        spec: &Conv2dSpec,
    ) -> Buf<E> {
        hit();
        Buf(Cpu.conv2d_backward_input(v(g), v(w), spec))
    }
    fn conv2d_backward_weight<E: Precision>(
        &self,
        x: Option<(&Buf<E>, &Layout)>,
        g: (&Buf<E>, &Layout),
        spec: &Conv2dSpec,
        bias: bool,
    ) -> (Option<Buf<E>>, Option<Buf<E>>) {
        hit();
        let (gw, gb) = Cpu.conv2d_backward_weight(x.map(v), v(g), spec, bias);
        (gw.map(Buf), gb.map(Buf))
    }
    fn max_pool2d<E: Precision>(&self, x: &Buf<E>, l: &Layout, spec: &Pool2dSpec) -> Buf<E> {
        hit();
        Buf(Cpu.max_pool2d(&x.0, l, spec))
    }
    fn max_pool2d_backward<E: Precision>(
        &self,
        x: (&Buf<E>, &Layout),
        g: (&Buf<E>, &Layout),
        spec: &Pool2dSpec,
    ) -> Buf<E> {
        hit();
        Buf(Cpu.max_pool2d_backward(v(x), v(g), spec))
    }
    fn avg_pool2d<E: Precision>(&self, x: &Buf<E>, l: &Layout, spec: &Pool2dSpec) -> Buf<E> {
        hit();
        Buf(Cpu.avg_pool2d(&x.0, l, spec))
    }
    fn avg_pool2d_backward<E: Precision>(&self, g: &Buf<E>, l: &Layout, spec: &Pool2dSpec) -> Buf<E> {
        hit();
        Buf(Cpu.avg_pool2d_backward(&g.0, l, spec))
    }
    fn batch_norm<E: Precision>(
        &self,
        x: (&Buf<E>, &Layout),
        weight: Option<(&Buf<E::Acc>, &Layout)>,
        bias: Option<(&Buf<E::Acc>, &Layout)>,
        stats: BatchNormStats<'_, Buf<f32>>,
        eps: f64,
    ) -> (Buf<E>, Self::RowStats<E>) {
        hit();
        let stats = match stats {
            BatchNormStats::Batch { running, momentum } => {
                BatchNormStats::Batch { running: running.map(|(m, v)| (&mut m.0, &mut v.0)), momentum }
            }
            BatchNormStats::Given { mean, var } => BatchNormStats::Given { mean: v(mean), var: v(var) },
        };
        let (y, stats) = Cpu.batch_norm(v(x), weight.map(v), bias.map(v), stats, eps);
        (Buf(y), stats)
    }
    fn batch_norm_backward<E: Precision>(
        &self,
        x: (&Buf<E>, &Layout),
        g: (&Buf<E>, &Layout),
        weight: Option<(&Buf<E::Acc>, &Layout)>,
        stats: &Self::RowStats<E>,
        needs: (bool, bool),
        training: bool,
    ) -> (Buf<E>, Option<Buf<E::Acc>>, Option<Buf<E::Acc>>) {
        hit();
        let (gx, gw, gb) = Cpu.batch_norm_backward(v(x), v(g), weight.map(v), stats, needs, training);
        (Buf(gx), gw.map(Buf), gb.map(Buf))
    }
    fn gather_rows<E: Precision>(&self, w: (&Buf<E>, &Layout), ids: &[i64], d: usize) -> Buf<E> {
        hit();
        Buf(Cpu.gather_rows(v(w), ids, d))
    }
    fn scatter_add_rows<E: Precision>(&self, g: (&Buf<E>, &Layout), ids: &[i64], vocab: usize, d: usize) -> Buf<E> {
        hit();
        Buf(Cpu.scatter_add_rows(v(g), ids, vocab, d))
    }
    fn cat<E: Precision>(&self, parts: &[(&Buf<E>, &Layout, usize)], outer: usize, inner: usize) -> Buf<E> {
        hit();
        let parts: Vec<_> = parts.iter().map(|(s, l, d)| (&s.0, *l, *d)).collect();
        Buf(Cpu.cat(&parts, outer, inner))
    }
    fn dropout<E: Precision>(&self, x: &Buf<E>, l: &Layout, p: f64, seed: u64) -> Buf<E> {
        hit();
        Buf(Cpu.dropout(&x.0, l, p, seed))
    }
    fn unscale_check<E: Precision>(
        &self,
        grads: &mut [&mut Buf<E>],
        scale: Option<&Buf<f64>>,
        found_inf: &mut Buf<f32>,
        first_flag: usize,
    ) {
        hit();
        let mut inner: Vec<_> = grads.iter_mut().map(|g| &mut g.0).collect();
        Cpu.unscale_check(&mut inner, scale.map(|s| &s.0), &mut found_inf.0, first_flag)
    }
    fn update_scale(&self, state: &mut Buf<f64>, found_inf: &Buf<f32>, rule: &ScaleRule) {
        hit();
        Cpu.update_scale(&mut state.0, &found_inf.0, rule)
    }
    fn norm_into<E: Precision>(&self, x: &Buf<E>, l: &Layout, out: &mut Buf<f32>, at: usize) {
        hit();
        Cpu.norm_into(&x.0, l, &mut out.0, at)
    }
    fn clip_coefficient(&self, norms: &Buf<f32>, max_norm: f32, out: &mut Buf<f32>) {
        hit();
        Cpu.clip_coefficient(&norms.0, max_norm, &mut out.0)
    }
    fn scale_in_place<E: Precision>(&self, x: &mut Buf<E>, k: &Buf<f32>, at: usize) {
        hit();
        Cpu.scale_in_place(&mut x.0, &k.0, at)
    }
    type Value<T: Scalar> = Lazy<T>;
    fn value<T: Scalar>(&self, read: impl FnOnce() -> T + Send + 'static) -> Lazy<T> {
        Lazy::new(read)
    }
    fn clamp_in_place<E: Precision>(&self, x: &mut Buf<E>, c: f32) {
        hit();
        Cpu.clamp_in_place(&mut x.0, c)
    }
    type StateVec = StateBuf;
    fn state_zeros(&self, n: usize) -> StateBuf {
        StateBuf(Cpu.state_zeros(n))
    }
    fn state_from_host(&self, v: Vec<f32>) -> StateBuf {
        StateBuf(v)
    }
    fn state_to_host(&self, v: &StateBuf) -> Vec<f32> {
        host_read();
        v.0.clone()
    }
    fn state_len(&self, v: &StateBuf) -> usize {
        v.0.len()
    }
    fn sgd_update(
        &self,
        rows: &[SgdArgs],
        param: &mut Buf<f32>,
        grad: &Buf<f32>,
        momentum_buffer: Option<&mut StateBuf>,
        outcomes: Option<Outcomes<'_, Buf<f32>>>,
    ) {
        hit();
        let outcomes = outcomes.map(|o| Outcomes { flags: &o.flags.0, at: o.at });
        Cpu.sgd_update(rows, &mut param.0, &grad.0, momentum_buffer.map(|b| &mut b.0), outcomes)
    }
    fn adam_update(
        &self,
        rows: &[AdamArgs],
        param: &mut Buf<f32>,
        grad: &Buf<f32>,
        exp_avg: &mut StateBuf,
        exp_avg_sq: &mut StateBuf,
        outcomes: Option<Outcomes<'_, Buf<f32>>>,
    ) {
        hit();
        let outcomes = outcomes.map(|o| Outcomes { flags: &o.flags.0, at: o.at });
        Cpu.adam_update(rows, &mut param.0, &grad.0, &mut exp_avg.0, &mut exp_avg_sq.0, outcomes)
    }
    fn write_bf16(&self, updated: &Buf<f32>, param: &mut Buf<bf16>, mode: Bf16Write, comp: Option<&mut Buf<bf16>>) {
        hit();
        Cpu.write_bf16(&updated.0, &mut param.0, mode, comp.map(|c| &mut c.0))
    }
}
