//! AMX-BF16 tiles for the bf16 GEMM ([`super::gemm_half`]): detection, the Linux permission
//! request, the tile configuration and the 32×32 block kernel.
//!
//! Design notes:
//! - AMX has eight tile registers of up to 16 rows × 64 bytes. `tdpbf16ps` multiplies a
//!   16 × 32 bf16 tile of A (16 rows, 16 pairs of k each) by a tile of B holding 16 k pairs ×
//!   16 columns (row p: the pairs (B[2p][j], B[2p+1][j]) for 16 columns j) and adds the
//!   products, paired in f32 as `vdpbf16ps` does, into a 16 × 16 f32 tile. B's layout is the
//!   one the `vdpbf16ps` kernel already packs (a panel of 32 columns per step), so the two
//!   kernels share B's packing. A is packed into tiles: per 32 rows and 16 k pairs, 2 KiB
//!   holding both 16-row tiles, each row's 16 pairs in 64 contiguous bytes.
//! - Every tile load reads cache-line-aligned rows (the pack buffers and the f32 block of C
//!   are aligned to 64 bytes, with row strides a multiple of 64): on a Xeon with AMX a tile
//!   load from rows straddling two lines took 17 ns against 3 ns, and an unaligned kernel
//!   ran at 0.6× the speed of the aligned one.
//! - The block kernel keeps a 32 × 32 f32 block of C in four tiles (tmm0–3), loads two A tiles
//!   (tmm4–5) and two B tiles (tmm6–7) per 16 k pairs and issues four `tdpbf16ps`: four
//!   loads per four products. All eight tiles are 16 rows × 64 bytes, one configuration per
//!   thread for a whole product. While a chunk's products run, B's next chunk is prefetched
//!   into L1 (B streams from L2 in the usual loop order; see `prefetch_next_chunk`).
//! - f16 products run on the same kernel, each value split into bf16 high and low parts
//!   ([`super::amx_f16`]): B then holds two chunks (high, low) per chunk of A, and the block
//!   kernel multiplies both by A's tiles, loaded once.
//! - Linux keeps tile data disabled for a process until it asks (`arch_prctl` with
//!   `ARCH_REQ_XCOMP_PERM`); without the grant the first tile instruction faults. The request
//!   is made once per process, by [`available`], and a refusal means the AMX kernel is not
//!   used. Other operating systems are not asked and get the `vdpbf16ps` kernel.
//! - `AMP_CPU_AMX=off` turns the tiles off for the process (A/B benchmarks); the `vdpbf16ps`
//!   kernel then runs. `AMP_CPU_ISA` does not: it caps the SIMD level of the loops around the
//!   GEMMs, and the GEMM kernels are chosen by their own features, as `vdpbf16ps` always was.
//! - Tile registers are not part of the Rust/LLVM register model: no compiled code touches
//!   them unless it uses AMX, which this crate does only here, between [`Tiles::configure`]
//!   and the drop of the returned guard (`tilerelease`), on one thread.
//! - Numerics: `tdpbf16ps` treats denormal bf16 inputs as zero, flushes denormal results and
//!   rounds each f32 addition to nearest even, as `vdpbf16ps` does.

use std::sync::OnceLock;

/// Whether the bf16 GEMM runs on AMX tiles here: the CPU has AMX-BF16 and AMX-TILE (and
/// AVX-512 BF16 for the k tails), the OS enabled tile state and granted this process tile
/// data, and `AMP_CPU_AMX` is not `off`. Decided once per process.
pub(crate) fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| !turned_off() && detect())
}

/// Whether `AMP_CPU_AMX` is `off` (or `0`).
fn turned_off() -> bool {
    super::env_off("AMP_CPU_AMX")
}

/// Why AMX is or is not used, for reports: `None` when it runs.
pub(crate) fn status() -> Option<&'static str> {
    match (available(), turned_off()) {
        (true, _) => None,
        (false, true) => Some("turned off by AMP_CPU_AMX"),
        (false, false) => Some("not on this CPU or not granted by the OS"),
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    // SAFETY: `cpuid` exists on every x86_64 CPU (recent Rust makes the intrinsic safe; the
    // block keeps the crate building on its minimum version, 1.89).
    #[allow(unused_unsafe)]
    let cpuid = |leaf, sub| unsafe { std::arch::x86_64::__cpuid_count(leaf, sub) };
    // Leaves 1 and 7 exist when the maximum leaf (leaf 0's eax) says so.
    if cpuid(0, 0).eax < 7 {
        return false;
    }
    let (leaf1, leaf7) = (cpuid(1, 0), cpuid(7, 0));
    let amx_bf16 = leaf7.edx >> 22 & 1 == 1;
    let amx_tile = leaf7.edx >> 24 & 1 == 1;
    let osxsave = leaf1.ecx >> 27 & 1 == 1;
    if !(amx_bf16 && amx_tile && osxsave && is_x86_feature_detected!("avx512bf16")) {
        return false;
    }
    // SAFETY: osxsave (checked above) means xgetbv is enabled.
    let xcr0 = unsafe { xcr0() };
    // XTILECFG (bit 17) and XTILEDATA (bit 18) enabled by the OS.
    if xcr0 >> 17 & 3 != 3 {
        return false;
    }
    request_tile_data()
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// XCR0, the OS-enabled state components.
///
/// # Safety
/// The CPU must report OSXSAVE.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
#[target_feature(enable = "xsave")]
unsafe fn xcr0() -> u64 {
    // SAFETY: the caller guarantees OSXSAVE, so xgetbv does not fault.
    unsafe { std::arch::x86_64::_xgetbv(0) }
}

/// Asks Linux for permission to use tile data (`arch_prctl(ARCH_REQ_XCOMP_PERM,
/// XFEATURE_XTILEDATA)`): true when granted (or already granted).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_data() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: a plain Linux x86_64 system call: arguments in rdi/rsi, number and result in
    // rax, rcx and r11 clobbered by `syscall`; it reads and writes no memory of ours.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

/// Rows of C (and of A) one block covers: two tiles of 16.
pub(crate) const BLOCK_ROWS: usize = 32;
/// k pairs one tile of A covers (64 bytes per row).
pub(crate) const PAIRS: usize = 16;

/// The tile configuration this kernel uses: palette 1, all eight tiles 16 rows × 64 bytes.
#[repr(C, align(64))]
struct Config([u8; 64]);

const CONFIG: Config = {
    let mut c = [0u8; 64];
    c[0] = 1; // palette 1
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = 64; // bytes per row (u16, little endian)
        c[48 + t] = 16; // rows
        t += 1;
    }
    Config(c)
};

/// What a block's sums start from ([`Tiles::block`]).
#[derive(Clone, Copy)]
pub(crate) enum Start {
    /// The f32 block of C as it is (a later k block adds to it).
    Sums,
    /// Zero.
    Zero,
    /// 32 f32 of a bias, the same for every row (64-byte aligned for speed).
    Bias(*const f32),
}

/// The tiles configured on this thread; released (`tilerelease`) on drop. Not `Send`: the
/// configuration belongs to the thread that loaded it.
pub(crate) struct Tiles(std::marker::PhantomData<*const ()>);

impl Tiles {
    /// Loads the tile configuration on this thread.
    ///
    /// # Safety
    /// [`available`] must have returned true (the CPU has AMX and the process holds the
    /// permission), and no other `Tiles` may be live on this thread.
    #[cfg(target_arch = "x86_64")]
    pub(crate) unsafe fn configure() -> Tiles {
        // SAFETY: the caller guarantees AMX is usable; CONFIG is a valid 64-byte palette-1
        // configuration (reserved bytes zero, each tile within 16 rows × 64 bytes).
        unsafe { std::arch::asm!("ldtilecfg [{0}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly)) };
        Tiles(std::marker::PhantomData)
    }

    /// `c[32 × 32] += a[32 rows × 16·chunks pairs] · b[16·chunks pairs × 32 columns]`: C's f32
    /// rows `ldc` floats apart; A in [`super::gemm_half`]'s tiled layout (chunk q of 16 pairs:
    /// 32 rows of 64 bytes from byte 2048·q); B a packed panel of 32 columns (step s at
    /// `b[32 s]`, 128 bytes a step). Every pointer and `4·ldc` should be multiples of 64: the
    /// result does not depend on it, the speed does.
    ///
    /// `b_per_a` chunks of B (1 or more) are multiplied by each chunk of A, loaded once: chunk
    /// q of A meets B's chunks `b_per_a·q ..` (the f16 split, [`super::amx_f16`], pairs each
    /// A chunk with a chunk of high and one of low parts of B).
    ///
    /// `start` says what the sums start from: C's block as it is, zero, or a bias row
    /// (`c = a · b` or `c = bias + a · b`, C's block then only written).
    ///
    /// # Safety
    /// `a` must be readable for 2048·chunks bytes, `b` for 512·chunks·b_per_a u32, `c`
    /// readable and writable for 32 floats at each of its 32 rows, and a bias start readable
    /// for 32 floats.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[allow(clippy::too_many_arguments)] // the block's operands, its start and B's chunks per A's
    pub(crate) unsafe fn block(
        &self,
        chunks: usize,
        b_per_a: usize,
        a: *const u8,
        b: *const u32,
        c: *mut f32,
        ldc: usize,
        start: Start,
    ) {
        use std::arch::asm;
        let c_row = ldc * 4;
        const A_ROW: usize = 64;
        const A_CHUNK: usize = 32 * 64;
        const B_ROW: usize = 32 * 4;
        // SAFETY: for every asm block here, the tiles are configured (`self` exists), and each
        // load and store stays inside the regions the caller guarantees: C rows 0–15 and 16–31
        // at columns 0–15 and 16–31; the bias's 32 floats (a stride-0 load reads its 64 bytes
        // 16 times); A's 2 KiB of chunk q; B's chunk b_per_a·q + r, steps 16 of them from
        // 16·(b_per_a·q + r), at columns 0–15 and 16–31.
        unsafe {
            let c16 = c.add(16 * ldc);
            match start {
                Start::Zero => {
                    asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem))
                }
                // A row stride of 0 loads the same 64 bytes into all 16 rows of a tile.
                Start::Bias(bias) => asm!(
                    "tileloadd tmm0, [{b} + {s}*1]",
                    "tileloadd tmm1, [{b} + {s}*1 + 64]",
                    "tileloadd tmm2, [{b} + {s}*1]",
                    "tileloadd tmm3, [{b} + {s}*1 + 64]",
                    b = in(reg) bias, s = in(reg) 0usize,
                    options(nostack, readonly),
                ),
                Start::Sums => asm!(
                    "tileloadd tmm0, [{c} + {s}*1]",
                    "tileloadd tmm1, [{c} + {s}*1 + 64]",
                    "tileloadd tmm2, [{c16} + {s}*1]",
                    "tileloadd tmm3, [{c16} + {s}*1 + 64]",
                    c = in(reg) c, c16 = in(reg) c16, s = in(reg) c_row,
                    options(nostack, readonly),
                ),
            }
            let a16 = a.add(16 * A_ROW);
            for q in 0..chunks {
                let (aq, a16q) = (a.add(A_CHUNK * q), a16.add(A_CHUNK * q));
                for r in 0..b_per_a {
                    let bq = b.add(512 * (b_per_a * q + r));
                    if r == 0 {
                        asm!("tileloadd tmm4, [{a} + {sa}*1]", a = in(reg) aq, sa = in(reg) A_ROW, options(nostack, readonly));
                    }
                    asm!("tileloadd tmm6, [{b} + {sb}*1]", b = in(reg) bq, sb = in(reg) B_ROW, options(nostack, readonly));
                    prefetch_next_chunk(bq, 0);
                    asm!(
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tileloadd tmm7, [{b} + {sb}*1 + 64]",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        b = in(reg) bq, sb = in(reg) B_ROW,
                        options(nostack, readonly),
                    );
                    if r == 0 {
                        asm!("tileloadd tmm5, [{a} + {sa}*1]", a = in(reg) a16q, sa = in(reg) A_ROW, options(nostack, readonly));
                    }
                    prefetch_next_chunk(bq, 16);
                    asm!("tdpbf16ps tmm2, tmm5, tmm6", "tdpbf16ps tmm3, tmm5, tmm7", options(nostack, nomem));
                }
            }
            asm!(
                "tilestored [{c} + {s}*1], tmm0",
                "tilestored [{c} + {s}*1 + 64], tmm1",
                "tilestored [{c16} + {s}*1], tmm2",
                "tilestored [{c16} + {s}*1 + 64], tmm3",
                c = in(reg) c, c16 = in(reg) c16, s = in(reg) c_row,
                options(nostack),
            );
        }
    }
}

/// Asks for 16 cache lines of B's next chunk (the 2 KiB after the chunk at `chunk`), from
/// line `first` of it, into L1 (`prefetcht0`) while the current chunk's products run. When
/// each block is rounded at once (`gemm_half`'s direct path) A's block stays in L1 and B's
/// panels, laid out one after another, stream from L2: the tile loads of B waited on L2, and
/// a synthetic loop of the kernel at `qkv`'s sizes ran 1.2x slower without this. In the
/// two-pass path B's chunk is usually in L1 already and the prefetch costs little. (Fetching
/// A's next chunk instead gained less on every bench shape.) Past the end of B it fetches
/// lines no one reads: a prefetch never faults, and `wrapping_add` makes the address without
/// claiming it lies inside an object.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_next_chunk(chunk: *const u32, first: usize) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    let next = chunk.cast::<i8>().wrapping_add(2048 + 64 * first);
    for line in 0..16 {
        // SAFETY: a prefetch is a hint: it never faults and reads or writes nothing visible.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(64 * line)) };
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a `Tiles` exists only after `configure` succeeded on this thread;
        // `tilerelease` returns the tile state to its initial (unconfigured) state.
        unsafe {
            std::arch::asm!("tilerelease", options(nostack, nomem))
        };
    }
}
