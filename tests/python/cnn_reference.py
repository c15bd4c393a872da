"""Regenerates amp-core/tests/data/cnn_reference.json: a fixed-weight CNN's forward, loss,
gradients and batch-norm running statistics computed by PyTorch in f32 (CPU), which
amp-core/tests/cnn_parity.rs compares against within 1e-5.

Every weight and input is a closed-form function of its index (`fill` below), so the Rust
test builds the same values without reading any tensor from this file but the results.

Run: python3 tests/python/cnn_reference.py  (needs torch)
"""
import json, math, os
import torch
import torch.nn.functional as F

torch.set_num_threads(1)

def fill(shape, offset, scale):
    n = math.prod(shape)
    v = [math.sin(0.37 * i + offset) * scale for i in range(n)]
    return torch.tensor(v, dtype=torch.float64).to(torch.float32).reshape(shape)

x = fill([2, 3, 9, 9], 0.1, 1.0)
w1 = fill([8, 3, 3, 3], 0.2, 0.3).requires_grad_()
b1 = fill([8], 0.3, 0.1).requires_grad_()
g1 = (fill([8], 0.4, 0.2) + 1.0).detach().requires_grad_()
be1 = fill([8], 0.5, 0.1).requires_grad_()
w2 = fill([8, 4, 3, 3], 0.6, 0.3).requires_grad_()   # groups = 2
g2 = (fill([8], 0.7, 0.2) + 1.0).detach().requires_grad_()
be2 = fill([8], 0.8, 0.1).requires_grad_()
wl = fill([5, 8], 0.9, 0.4).requires_grad_()
bl = fill([5], 1.0, 0.1).requires_grad_()
rm1, rv1 = torch.zeros(8), torch.ones(8)
rm2, rv2 = torch.zeros(8), torch.ones(8)
targets = torch.tensor([1, 4])

h = F.conv2d(x, w1, b1, stride=1, padding=1)                       # [2, 8, 9, 9]
h = F.batch_norm(h, rm1, rv1, g1, be1, training=True, momentum=0.1, eps=1e-5).relu()
h = F.max_pool2d(h, 3, stride=2, padding=1)                        # [2, 8, 5, 5]
h = F.conv2d(h, w2, None, stride=2, padding=1, dilation=1, groups=2)  # [2, 8, 3, 3]
h = F.batch_norm(h, rm2, rv2, g2, be2, training=True, momentum=0.1, eps=1e-5).relu()
h = F.avg_pool2d(h, 2, stride=1, padding=0)                        # [2, 8, 2, 2]
h = F.adaptive_avg_pool2d(h, (1, 1)).flatten(1)                   # [2, 8]
logits = F.linear(h, wl, bl)
loss = F.cross_entropy(logits, targets)
loss.backward()

out = {
    "torch_version": torch.__version__,
    "loss": loss.item(),
    "logits": logits.detach().flatten().tolist(),
    "grads": {n: t.grad.flatten().tolist() for n, t in
              [("w1", w1), ("b1", b1), ("g1", g1), ("be1", be1), ("w2", w2), ("g2", g2), ("be2", be2), ("wl", wl), ("bl", bl)]},
    "running": {"rm1": rm1.tolist(), "rv1": rv1.tolist(), "rm2": rm2.tolist(), "rv2": rv2.tolist()},
}
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "amp-core", "tests", "data", "cnn_reference.json")
os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path, "w") as f:
    json.dump(out, f, indent=1)
print(f"wrote {path}: loss {out['loss']:.6f} (torch {torch.__version__})")
