use amp::prelude::*;

fn a(x: &Tensor<f32>) -> Tensor<f32> {
    x.clone()
}

#[autocast(f16, bf16)]
fn one(x: &Tensor<f32>) -> Tensor<f32> {
    a(x)
}

#[autocast(fp32 = [a], fp32 = [b])]
fn two(x: &Tensor<f32>) -> Tensor<f32> {
    a(x)
}

#[autocast(fp32 = [a], lower = [a])]
fn three(x: &Tensor<f32>) -> Tensor<f32> {
    a(x)
}

fn main() {}
