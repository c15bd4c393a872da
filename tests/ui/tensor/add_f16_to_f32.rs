// Adding an f16 tensor to an f32 tensor is a type error: cast one side explicitly.
use amp::prelude::*;

fn main() {
    let a = Tensor::<f32>::ones(&[2]);
    let b = Tensor::<f16>::ones(&[2]);
    let _ = a.add(&b);
    let _ = &a + &b;
}
