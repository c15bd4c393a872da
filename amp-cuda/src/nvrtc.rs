//! Compiling kernel programs with NVRTC: the one function the backend uses at run time
//! ([`compile_ptx`], `compute_90` PTX that the driver JIT-compiles for the GPU it runs on), and
//! a check that also runs the assembler ([`assemble_sm90`]), for machines without a GPU.
//!
//! Design notes:
//! - libnvrtc is loaded at run time (cudarc's `dynamic-loading`), found by its name on the
//!   library path (`libnvrtc.so.13` from CUDA 13 or the `nvidia-cuda-nvrtc` wheel's
//!   `nvidia/cu13/lib`: put that folder on `LD_LIBRARY_PATH`). cudarc panics when it cannot
//!   load the library, so [`nvrtc_status`] checks with cudarc's non-panicking probe
//!   (`nvrtc::sys::is_culib_present`) first, and calls NVRTC's version query inside
//!   `catch_unwind` (a library without a symbol the bindings name panics too).
//! - PTX for a virtual architecture is not assembled: an inline-PTX typo would only fail when
//!   the driver loads the module. [`assemble_sm90`] compiles the same source for the real
//!   `sm_90`, which makes NVRTC run ptxas, so CI catches those without a GPU; ptxas's report
//!   of each kernel's registers, spills and static shared memory comes back with it
//!   ([`KernelResources`]), so CI checks those too (a launch fails, or an SM holds few blocks,
//!   when they grow).

use std::ffi::{CStr, CString, c_char};
use std::sync::OnceLock;

use amp_core::Error;
use cudarc::nvrtc::{result, sys};

use crate::kernels::Program;

/// The architecture kernels are compiled for at run time: Hopper's virtual architecture (the
/// H200), which the driver JIT-compiles for the GPU it runs on (sm_90 and later).
pub const ARCH: &str = "compute_90";

fn nvrtc_error(detail: impl Into<String>) -> Error {
    Error::Device { op: "nvrtc", device: "cuda".into(), detail: detail.into() }
}

/// Whether libnvrtc can be loaded and answers, with its version; the error says what is
/// missing. Checked once per process.
pub fn nvrtc_status() -> Result<(i32, i32), Error> {
    static STATUS: OnceLock<Result<(i32, i32), String>> = OnceLock::new();
    STATUS
        .get_or_init(|| {
            // SAFETY: the probe only tries to dlopen cudarc's candidate names and closes them;
            // it runs no code of the library.
            if !unsafe { sys::is_culib_present() } {
                return Err(format!(
                    "libnvrtc was not found on the library path (tried {}); install the CUDA toolkit or `pip \
                     install nvidia-cuda-nvrtc` and put its nvidia/cu13/lib folder on LD_LIBRARY_PATH",
                    tried("nvrtc")
                ));
            }
            std::panic::catch_unwind(|| {
                let (mut major, mut minor) = (0, 0);
                // SAFETY: both pointers are valid for writes of one c_int each.
                unsafe { sys::nvrtcVersion(&mut major, &mut minor) }.result().map(|()| (major, minor))
            })
            .map_err(|p| format!("libnvrtc could not be used: {}", panic_message(&p)))?
            .map_err(|e| format!("nvrtcVersion failed: {e:?}"))
        })
        .clone()
        .map_err(nvrtc_error)
}

/// The library names cudarc tried for `lib`, in short: the first plain ones and a count.
pub(crate) fn tried(lib: &str) -> String {
    let mut names = cudarc::get_lib_name_candidates(lib);
    names.dedup();
    let prefix = format!("lib{lib}.so");
    let major: Vec<&String> = names.iter().filter(|n| n.starts_with(&prefix)).collect();
    let shown: Vec<&str> = major.iter().take(3).map(|s| s.as_str()).collect();
    format!("{} and {} other names", shown.join(", "), names.len().saturating_sub(shown.len()))
}

/// The text of a caught panic's payload.
pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}

/// What NVRTC made of a program.
struct Output {
    ptx: String,
    cubin_bytes: usize,
    log: String,
}

/// What ptxas reports for one kernel assembled for `sm_90`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelResources {
    /// The kernel's `extern "C"` name.
    pub name: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of static shared memory (`__shared__` arrays); dynamic shared memory comes on top.
    pub static_shared_bytes: u32,
    /// Bytes of registers spilled to local memory (stores).
    pub spill_store_bytes: u32,
}

/// A program assembled for `sm_90`.
#[derive(Clone, Debug)]
pub struct Assembled {
    /// The size of the machine code.
    pub cubin_bytes: usize,
    /// ptxas's report, one entry per kernel.
    pub kernels: Vec<KernelResources>,
}

/// The kernels' resources from ptxas's verbose log (`--ptxas-options=-v`): a kernel's lines
/// start at `Compiling entry function 'NAME'`, its spills are on the `spill stores` line and its
/// registers and static shared memory on the `Used N registers` line.
fn parse_ptxas_log(log: &str) -> Vec<KernelResources> {
    let number_before = |line: &str, unit: &str| -> Option<u32> {
        let at = line.find(unit)?;
        line[..at].split_whitespace().last()?.parse().ok()
    };
    let mut out: Vec<KernelResources> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            out.push(KernelResources { name, registers: 0, static_shared_bytes: 0, spill_store_bytes: 0 });
        } else if let Some(k) = out.last_mut() {
            if let Some(n) = number_before(line, " bytes spill stores") {
                k.spill_store_bytes = n;
            }
            if let Some(n) = number_before(line, " registers") {
                k.registers = n;
                k.static_shared_bytes = number_before(line, " bytes smem").unwrap_or(0);
            }
        }
    }
    out
}

/// Creates, compiles and reads back one program for `arch`; the error carries NVRTC's log.
fn compile(program: &Program, arch: &str, cubin: bool) -> Result<Output, Error> {
    nvrtc_status()?;
    let src = CString::new(program.source.as_str()).map_err(|_| nvrtc_error("kernel source holds a NUL byte"))?;
    let name = CString::new(format!("{}.cu", program.name)).map_err(|_| nvrtc_error("program name holds a NUL"))?;
    let prog = result::create_program(&src, Some(&name))
        .map_err(|e| nvrtc_error(format!("{}: nvrtcCreateProgram failed: {e:?}", program.name)))?;
    let mut options = vec![format!("--gpu-architecture={arch}"), "-std=c++17".to_string()];
    if cubin {
        options.push("--ptxas-options=-v".to_string());
    }
    let out = (|| {
        // SAFETY: `prog` was created above and is destroyed only after this closure.
        if let Err(e) = unsafe { result::compile_program(prog, &options) } {
            // SAFETY: as above.
            let log = unsafe { result::get_program_log(prog) }.map(|l| c_text(&l)).unwrap_or_default();
            return Err(nvrtc_error(format!(
                "{} does not compile for {arch} ({e:?}):\n{}",
                program.name,
                log.trim_end()
            )));
        }
        // SAFETY: as above; the program compiled.
        let ptx = unsafe { result::get_ptx(prog) }
            .map(|p| c_text(&p))
            .map_err(|e| nvrtc_error(format!("{}: nvrtcGetPTX failed: {e:?}", program.name)))?;
        let mut cubin_bytes = 0usize;
        if cubin {
            // SAFETY: as above; `cubin_bytes` is valid for one write.
            unsafe { sys::nvrtcGetCUBINSize(prog, &mut cubin_bytes) }
                .result()
                .map_err(|e| nvrtc_error(format!("{}: nvrtcGetCUBINSize failed: {e:?}", program.name)))?;
        }
        // SAFETY: as above.
        let log = unsafe { result::get_program_log(prog) }.map(|l| c_text(&l)).unwrap_or_default();
        Ok(Output { ptx, cubin_bytes, log })
    })();
    // SAFETY: `prog` came from create_program and is destroyed once, here.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

/// The text of a NUL-terminated buffer NVRTC filled.
fn c_text(buf: &[c_char]) -> String {
    if buf.is_empty() {
        return String::new();
    }
    // SAFETY: NVRTC's log and PTX buffers are NUL-terminated within their reported size.
    unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
}

/// Compiles a program to PTX for [`ARCH`]: what the backend loads at run time (once per
/// device and program). The error names the program and carries NVRTC's log.
pub fn compile_ptx(program: &Program) -> Result<String, Error> {
    compile(program, ARCH, false).map(|o| o.ptx)
}

/// Compiles a program for the real `sm_90` (NVRTC then runs the assembler, which checks the
/// inline PTX that [`compile_ptx`]'s virtual-architecture output leaves unchecked); returns
/// the size of the machine code and each kernel's registers, spills and static shared memory.
/// For CI and tests on machines without a GPU.
pub fn assemble_sm90(program: &Program) -> Result<Assembled, Error> {
    compile(program, "sm_90", true).map(|o| Assembled { cubin_bytes: o.cubin_bytes, kernels: parse_ptxas_log(&o.log) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_reports_are_read_per_kernel() {
        let log = "ptxas info    : 1 bytes gmem\n\
            ptxas info    : Compiling entry function 'softmax_fwd_bf16' for 'sm_90'\n\
            ptxas info    : Function properties for softmax_fwd_bf16\n\
            ptxas         .     0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n\
            ptxas info    : Used 21 registers, used 1 barriers, 144 bytes smem\n\
            ptxas info    : Compile time = 3.1 ms\n\
            ptxas info    : Compiling entry function 'softmax_warp_fwd_bf16' for 'sm_90'\n\
            ptxas info    : Used 55 registers, used 0 barriers\n";
        let got = parse_ptxas_log(log);
        assert_eq!(
            got,
            vec![
                KernelResources {
                    name: "softmax_fwd_bf16".into(),
                    registers: 21,
                    static_shared_bytes: 144,
                    spill_store_bytes: 8
                },
                KernelResources {
                    name: "softmax_warp_fwd_bf16".into(),
                    registers: 55,
                    static_shared_bytes: 0,
                    spill_store_bytes: 0
                },
            ]
        );
    }
}
