//! The `Cuda` device handle and the per-device state behind it: the context, the one stream,
//! the caching allocator, the cuBLAS handle and the compiled-kernel cache.
//!
//! Design notes:
//! - One state per GPU per process ([`shared_state`]): every `Cuda` handle for an ordinal
//!   shares it, so a device has exactly one stream, one allocator and one kernel cache however
//!   many handles exist. States live until the process exits (storage keeps its state alive
//!   anyway, to give its blocks back).
//! - Opening a device never panics: cudarc panics when it cannot load libcuda, so the driver
//!   library is probed first with cudarc's non-panicking `driver::sys::is_culib_present`; the
//!   driver calls that follow run inside `catch_unwind` (a driver older than the CUDA 13.0
//!   bindings lacks symbols, which cudarc reports by panicking), and every failure becomes an
//!   [`amp_core::Error::Device`] that names what is missing: the driver library, a device, the
//!   ordinal, cuBLAS or NVRTC.
//! - Kernels are compiled on first use and cached per (program, precision): each program is
//!   compiled by [`crate::nvrtc::compile_ptx`], loaded as a module, and all its functions are
//!   looked up once.
//! - All work goes to the device's stream in order, so freed blocks can be reused at once
//!   (see `crate::alloc`) and nothing but host reads (`to_host`, the flags and norms the trait
//!   returns to the host) waits for the GPU.
//! - The trait's kernel methods return values, not `Result`s: a driver error inside one (out
//!   of memory with nothing left to free, a failed launch) panics with a message naming the
//!   device, the op and the driver's error.

use std::any::TypeId;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use amp_core::{DType, Error};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, DriverError, result, sys};

use crate::alloc::{Block, CachingAllocator, MemoryStats, RawMemory};
use crate::kernels::{self, Family, Program};
use crate::nvrtc::{self, panic_message};

/// A CUDA GPU: the device type of `Tensor<E, Cuda>`.
///
/// Handles are cheap to clone and all handles of one ordinal share one state (stream,
/// allocator, kernel cache). [`Cuda::new`] opens a device and reports a missing driver, a
/// missing GPU or a bad ordinal as an [`Error`].
///
/// `Cuda::default()` (required by [`amp_core::Device`]) is device 0 opened lazily: it cannot
/// fail, so it does not touch the driver; the first copy or kernel on it opens device 0 and,
/// if that fails, panics with the message `Cuda::new(0)` would have returned as an error.
/// Code that must survive a machine without a GPU calls `Cuda::new` (or [`Cuda::available`])
/// first.
#[derive(Clone)]
pub struct Cuda {
    ordinal: usize,
    state: Arc<OnceLock<Arc<State>>>,
}

impl Default for Cuda {
    /// Device 0, opened on first use (see the type's docs).
    fn default() -> Self {
        Cuda { ordinal: 0, state: Arc::new(OnceLock::new()) }
    }
}

impl fmt::Debug for Cuda {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Cuda(cuda:{})", self.ordinal)
    }
}

impl Cuda {
    /// Opens GPU `ordinal`: its primary context, one stream, a cuBLAS handle and an empty
    /// caching allocator (shared with every other handle of that ordinal). Fails with an
    /// [`Error::Device`] naming what is missing: the NVIDIA driver library (libcuda), any GPU,
    /// the ordinal (out of range), cuBLAS or NVRTC.
    pub fn new(ordinal: usize) -> Result<Cuda, Error> {
        let state = shared_state(ordinal)?;
        Ok(Cuda { ordinal, state: Arc::new(OnceLock::from(state)) })
    }

    /// Whether GPU 0 can be opened, and if not, why (the error [`Cuda::new`] returns).
    pub fn available() -> Result<(), Error> {
        Cuda::new(0).map(drop)
    }

    /// The number of GPUs the driver sees; an error when there is no driver.
    pub fn device_count() -> Result<usize, Error> {
        driver_call("cuda", |_| CudaContext::device_count().map(|n| n as usize))
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's state, opening it on first use (a `Default` handle).
    pub(crate) fn state(&self) -> &Arc<State> {
        self.state.get_or_init(|| {
            shared_state(self.ordinal).unwrap_or_else(|e| {
                panic!("{e} (Cuda::default() opens device 0 on first use; call Cuda::new(0) to get this as an Error)")
            })
        })
    }

    /// The GPU's name as the driver reports it (`NVIDIA H200`).
    pub fn device_name(&self) -> String {
        self.state().device_name.clone()
    }

    /// The caching allocator's statistics (PyTorch's `memory_allocated`, `memory_reserved`,
    /// `max_memory_allocated`...).
    pub fn memory_stats(&self) -> MemoryStats {
        self.state().alloc.stats()
    }

    /// Frees every cached block back to the driver (after waiting for the stream); returns
    /// the bytes released (PyTorch's `torch.cuda.empty_cache`).
    pub fn empty_cache(&self) -> usize {
        self.state().enter();
        self.state().alloc.empty_cache()
    }

    /// Caps the bytes the allocator keeps cached (`usize::MAX`, the default: no cap).
    pub fn set_cache_limit(&self, bytes: usize) {
        self.state().enter();
        self.state().alloc.set_cache_limit(bytes)
    }

    /// Starts the peak of bytes in use over from now.
    pub fn reset_peak_memory_stats(&self) {
        self.state().alloc.reset_peak()
    }

    /// Lets f32 GEMMs run on TF32 tensor cores (`CUBLAS_COMPUTE_32F_FAST_TF32`: 10-bit
    /// mantissas in the products, f32 accumulation). Off by default, so f32 matmuls are f32
    /// throughout, like the CPU's (PyTorch's `torch.backends.cuda.matmul.allow_tf32`).
    /// Applies to every handle of this device.
    pub fn set_allow_tf32(&self, allow: bool) {
        self.state().tf32.store(allow, Ordering::Relaxed)
    }

    /// Whether f32 GEMMs may use TF32 ([`Cuda::set_allow_tf32`]).
    pub fn allow_tf32(&self) -> bool {
        self.state().tf32.load(Ordering::Relaxed)
    }

    /// Lets causal attention in f16 and bf16 with heads of 32 or 64 values run on the fused
    /// tensor-core kernels (FlashAttention-2's algorithm: no score tile in memory). On by
    /// default; off, it takes the other path: cuBLAS products by block of query rows over f32
    /// score tiles (PyTorch's `torch.backends.cuda.enable_flash_sdp`). Applies to every handle
    /// of this device; either path's forward pairs with either's backward.
    pub fn set_flash_attention(&self, enabled: bool) {
        self.state().flash_attention.store(enabled, Ordering::Relaxed)
    }

    /// Whether causal attention may take the fused kernels ([`Cuda::set_flash_attention`]).
    pub fn flash_attention(&self) -> bool {
        self.state().flash_attention.load(Ordering::Relaxed)
    }

    /// The blocking host-device calls made on this GPU since it was opened (by every handle):
    /// device-to-host copies (each waits for the stream), stream synchronisations, and the
    /// driver's frees (the caching allocator's releases; each synchronises the device). A
    /// training step that reads nothing back adds none; reading a step's loss or skipped flag
    /// adds one. Allocations from the driver do not wait for queued work and are not counted
    /// here: they are the allocator's misses ([`Cuda::memory_stats`]).
    pub fn blocking_calls(&self) -> u64 {
        self.state().waits.load(Ordering::Relaxed)
    }

    /// Waits until every kernel and copy queued on the device's stream has finished.
    pub fn synchronize(&self) {
        let st = self.state();
        st.waits.fetch_add(1, Ordering::Relaxed);
        st.check("synchronize", st.stream.synchronize());
    }
}

/// Runs driver calls with panics turned into errors, naming `device`.
fn driver_call<T>(device: &str, f: impl FnOnce(&str) -> Result<T, DriverError>) -> Result<T, Error> {
    let err = |detail: String| Error::Device { op: "Cuda::new", device: device.to_string(), detail };
    // SAFETY: the probe only tries to dlopen cudarc's candidate names and closes them again;
    // it runs no code of the library.
    if !unsafe { sys::is_culib_present() } {
        return Err(err(format!(
            "the NVIDIA driver library (libcuda) was not found (tried {}): no NVIDIA driver is installed, or its \
             folder is not on LD_LIBRARY_PATH",
            nvrtc::tried("cuda")
        )));
    }
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(device))) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(err(describe(e))),
        Err(p) => Err(err(format!("the CUDA driver could not be used: {}", panic_message(&*p)))),
    }
}

/// A driver error with a hint where the code has a common meaning.
fn describe(e: DriverError) -> String {
    let hint = match e.0 {
        sys::CUresult::CUDA_ERROR_NO_DEVICE => ": no CUDA-capable GPU is visible (CUDA_VISIBLE_DEVICES?)",
        sys::CUresult::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH => ": the driver and the CUDA libraries do not match",
        _ => "",
    };
    format!("{e:?}{hint}")
}

/// The process-wide state of GPU `ordinal`, opened on first request.
pub(crate) fn shared_state(ordinal: usize) -> Result<Arc<State>, Error> {
    static STATES: Mutex<Vec<(usize, Arc<State>)>> = Mutex::new(Vec::new());
    let mut states = STATES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, s)) = states.iter().find(|(o, _)| *o == ordinal) {
        return Ok(s.clone());
    }
    let state = Arc::new(State::open(ordinal)?);
    states.push((ordinal, state.clone()));
    Ok(state)
}

/// Device memory through the driver, for the caching allocator.
pub(crate) struct DriverMemory {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// The device's count of blocking calls ([`Cuda::blocking_calls`]).
    waits: Arc<AtomicU64>,
}

impl RawMemory for DriverMemory {
    type Error = DriverError;
    fn alloc(&self, bytes: usize) -> Result<u64, DriverError> {
        // Not a blocking call: cuMemAlloc does not wait for queued work (the allocator's
        // misses count these, `memory_stats().misses`); cuMemFree does, and is counted.
        self.ctx.bind_to_thread()?;
        // SAFETY: the context is current on this thread; the block is owned by the allocator
        // until it frees it.
        unsafe { result::malloc_sync(bytes) }
    }
    fn free(&self, ptr: u64) {
        self.waits.fetch_add(1, Ordering::Relaxed);
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: `ptr` came from `alloc`, is freed once (the allocator forgets it), and the
        // stream was synchronised so no queued work still uses it.
        self.ctx.record_err(unsafe { result::free_sync(ptr) });
    }
    fn synchronize(&self) {
        self.waits.fetch_add(1, Ordering::Relaxed);
        self.ctx.record_err(self.stream.synchronize());
    }
    fn is_out_of_memory(e: &DriverError) -> bool {
        e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY
    }
}

/// Which program a cached module was compiled from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum ModuleKey {
    /// A fixed family at a precision.
    Family(Family, DType),
    /// A cast from one precision to another.
    Cast(DType, DType),
    /// An elementwise op value (its type) at a precision.
    Op(TypeId, DType),
}

/// A kernel ready to launch, with its name for messages.
#[derive(Clone)]
pub(crate) struct Kernel {
    pub(crate) function: CudaFunction,
    pub(crate) name: String,
}

/// A loaded module and its functions by name.
struct Loaded {
    functions: HashMap<String, CudaFunction>,
    _module: Arc<CudaModule>,
}

/// Everything one GPU needs, shared by all its handles.
pub(crate) struct State {
    pub(crate) ordinal: usize,
    pub(crate) device_name: String,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) alloc: CachingAllocator<DriverMemory>,
    pub(crate) blas: Mutex<CudaBlas>,
    modules: Mutex<HashMap<ModuleKey, Loaded>>,
    pub(crate) tf32: AtomicBool,
    /// Whether causal attention may take the fused kernels ([`Cuda::set_flash_attention`]).
    pub(crate) flash_attention: AtomicBool,
    /// Blocking calls so far ([`Cuda::blocking_calls`]).
    pub(crate) waits: Arc<AtomicU64>,
}

impl State {
    fn open(ordinal: usize) -> Result<State, Error> {
        let device = format!("cuda:{ordinal}");
        let err = |detail: String| Error::Device { op: "Cuda::new", device: device.clone(), detail };
        let count = driver_call(&device, |_| CudaContext::device_count())?;
        if count <= 0 {
            return Err(err("no CUDA device: the driver sees no GPU".into()));
        }
        if ordinal >= count as usize {
            return Err(err(format!("device ordinal {ordinal} is out of range: the driver sees {count} GPU(s)")));
        }
        // SAFETY: as in driver_call's probe: dlopen attempts only.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(err(format!(
                "cuBLAS (libcublas) was not found (tried {}): install the CUDA toolkit or `pip install \
                 nvidia-cublas` and put its lib folder on LD_LIBRARY_PATH",
                nvrtc::tried("cublas")
            )));
        }
        nvrtc::nvrtc_status().map_err(|e| err(e.to_string()))?;
        let (ctx, stream, name) = driver_call(&device, |_| {
            let ctx = CudaContext::new(ordinal)?;
            // SAFETY: every kernel and copy of this crate runs on the one stream created
            // below, so stream order alone orders every use of a block; the allocator never
            // frees a block before synchronising (see `crate::alloc`).
            unsafe { ctx.disable_event_tracking() };
            let stream = ctx.new_stream()?;
            let name = ctx.name()?;
            Ok((ctx, stream, name))
        })?;
        let blas = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| CudaBlas::new(stream.clone())))
            .map_err(|p| err(format!("cuBLAS could not be used: {}", panic_message(&*p))))?
            .map_err(|e| err(format!("cublasCreate failed: {e:?}")))?;
        // f32 accumulation for f16 and bf16 all the way: no reduced-precision split-K reductions.
        let math = cudarc::cublas::sys::cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION;
        // SAFETY: the handle is valid (created above) and owned by `blas`.
        unsafe { cudarc::cublas::sys::cublasSetMathMode(*blas.handle(), math) }
            .result()
            .map_err(|e| err(format!("cublasSetMathMode failed: {e:?}")))?;
        let waits = Arc::new(AtomicU64::new(0));
        let mem = DriverMemory { ctx: ctx.clone(), stream: stream.clone(), waits: waits.clone() };
        Ok(State {
            ordinal,
            device_name: name,
            ctx,
            stream,
            alloc: CachingAllocator::new(mem),
            blas: Mutex::new(blas),
            modules: Mutex::new(HashMap::new()),
            tf32: AtomicBool::new(false),
            flash_attention: AtomicBool::new(true),
            waits,
        })
    }

    /// The device's name in messages.
    pub(crate) fn name(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    /// Makes the device's context current on this thread (raw driver calls need it).
    pub(crate) fn enter(&self) {
        self.check("cuCtxSetCurrent", self.ctx.bind_to_thread());
    }

    /// Unwraps a driver result, panicking with the device, the op and the error.
    pub(crate) fn check<T, E: fmt::Debug>(&self, what: &str, r: Result<T, E>) -> T {
        match r {
            Ok(v) => v,
            Err(e) => panic!("{}: {what}: {e:?}", self.name()),
        }
    }

    /// A block of at least `bytes` bytes from the caching allocator.
    pub(crate) fn take(&self, bytes: usize) -> Block {
        match self.alloc.take(bytes) {
            Ok(b) => b,
            Err(e) => {
                let s = self.alloc.stats();
                panic!(
                    "{}: cannot allocate {bytes} bytes ({e:?}); {} bytes in use, {} cached",
                    self.name(),
                    s.bytes_in_use,
                    s.bytes_cached
                )
            }
        }
    }

    /// The kernel `kernel` of the module `key`, compiling and loading `program()` on first use.
    pub(crate) fn function(&self, key: ModuleKey, program: impl FnOnce() -> Program, kernel: &str) -> Kernel {
        let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        let loaded = match modules.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(slot) => {
                let program = program();
                let ptx = nvrtc::compile_ptx(&program).unwrap_or_else(|e| panic!("{}: {e}", self.name()));
                let module = self.check(
                    &format!("loading the PTX of {}", program.name),
                    self.ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)),
                );
                let mut functions = HashMap::new();
                for k in &program.kernels {
                    let f = self.check(&format!("looking up kernel {k}"), module.load_function(k));
                    functions.insert(k.clone(), f);
                }
                slot.insert(Loaded { functions, _module: module })
            }
        };
        match loaded.functions.get(kernel) {
            Some(f) => Kernel { function: f.clone(), name: kernel.to_string() },
            None => panic!("{}: no kernel {kernel} in module {key:?}", self.name()),
        }
    }

    /// A fixed family's kernel at precision `dtype` (`stem` without the dtype suffix).
    pub(crate) fn family_fn(&self, family: Family, dtype: DType, stem: &str) -> Kernel {
        self.function(
            ModuleKey::Family(family, dtype),
            || kernels::family(family, dtype),
            &kernels::kernel_name(stem, dtype),
        )
    }
}
