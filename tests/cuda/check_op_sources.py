# Compiles the CUDA C expression of every elementwise op value in amp-core (`unary_op!`,
# `binary_op!` and the hand-written `UnaryOp` / `BinaryOp` impls) with NVRTC for compute_90,
# instantiated for float and double accumulators, so a typo in an op's CUDA half fails CI
# although no GPU is present. Usage: check_op_sources.py [path to libnvrtc.so]; without a
# path it finds the one that `pip install nvidia-cuda-nvrtc` put on sys.path.
# (Until amp-cuda compiles its kernels through the same NVRTC call from Rust.)
import ctypes, os, re, sys
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', 'amp-core', 'src', 'ops')
read = lambda name: open(os.path.join(root, name)).read()
src_un = read('unary.rs')
src_bin = read('binary.rs') + read('loss.rs')
ops = []
for m in re.finditer(r'cuda:\s*("(?:[^"\\]|\\.)*"),\s*("(?:[^"\\]|\\.)*")', src_un):
    ops.append(('u', eval(m.group(1)), eval(m.group(2))))
for m in re.finditer(r"CUDA_FORWARD: &'static str = (\"[^\"]*\");\s*const CUDA_DERIVATIVE: &'static str = (\"[^\"]*\");", src_un):
    ops.append(('u', eval(m.group(1)), eval(m.group(2))))
for m in re.finditer(r'cuda:\s*("(?:[^"\\]|\\.)*")\s*\n?\s*\)', src_bin):
    ops.append(('b', eval(m.group(1)), None))
for m in re.finditer(r"const CUDA: &'static str = (\"[^\"]*\");", src_bin):
    ops.append(('b', eval(m.group(1)), None))
body = []
for i, (k, f, df) in enumerate(ops):
    if k == 'u':
        body.append(f"template<typename acc_t> __device__ acc_t f{i}(acc_t x, acc_t p) {{ return {f}; }}")
        body.append(f"template<typename acc_t> __device__ acc_t d{i}(acc_t x, acc_t y, acc_t p) {{ return {df}; }}")
        body.append(f"extern \"C\" __global__ void k{i}(float* o, double* q) {{ o[0] = f{i}<float>(o[1], o[2]) + d{i}<float>(o[1], o[2], o[3]); q[0] = f{i}<double>(q[1], q[2]) + d{i}<double>(q[1], q[2], q[3]); }}")
    else:
        body.append(f"template<typename acc_t> __device__ acc_t b{i}(acc_t a, acc_t b, acc_t p) {{ return {f}; }}")
        body.append(f"extern \"C\" __global__ void k{i}(float* o, double* q) {{ o[0] = b{i}<float>(o[1], o[2], o[3]); q[0] = b{i}<double>(q[1], q[2], q[3]); }}")
code = "\n".join(body).encode()
def find_nvrtc():
    import glob
    for d in sys.path:
        for hit in sorted(glob.glob(os.path.join(d, 'nvidia', '*', 'lib', 'libnvrtc.so*'))):
            if 'builtins' not in hit:
                return hit
    sys.exit('libnvrtc not found: pip install nvidia-cuda-nvrtc')
lib = ctypes.CDLL(sys.argv[1] if len(sys.argv) > 1 else find_nvrtc())
prog = ctypes.c_void_p()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), code, b"ops.cu", 0, None, None) == 0
opts = [b"--gpu-architecture=compute_90", b"-std=c++17"]
arr = (ctypes.c_char_p * len(opts))(*opts)
rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
n = ctypes.c_size_t(); lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
log = ctypes.create_string_buffer(n.value); lib.nvrtcGetProgramLog(prog, log)
sz = ctypes.c_size_t(); lib.nvrtcGetPTXSize(prog, ctypes.byref(sz))
print(f"{len([o for o in ops if o[0]=='u'])} unary and {len([o for o in ops if o[0]=='b'])} binary op values; nvrtc rc={rc}; ptx bytes={sz.value}")
print(log.value.decode()[:3000])
expected = (15, 5)  # keep in step with the op files, so an expression the regexes miss is noticed
found = (len([o for o in ops if o[0] == 'u']), len([o for o in ops if o[0] == 'b']))
if found != expected:
    print(f"expected {expected} unary/binary op values, found {found}: update this script")
    sys.exit(1)
sys.exit(rc)
