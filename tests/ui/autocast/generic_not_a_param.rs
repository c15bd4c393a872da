use amp::prelude::*;

// `P` is a type parameter of the impl, not of the function: the macro sees only the
// function's own generics.
struct Model<P>(std::marker::PhantomData<P>);

impl<P: Precision> Model<P> {
    #[autocast(P)]
    fn forward(&self, x: &Tensor<f32>, w: &Param) -> Tensor<f32> {
        x.matmul(w)
    }
}

// A word that is not one of the function's type parameters.
#[autocast(Q)]
fn generic<P: Precision>(x: &Tensor<f32>, w: &Param) -> Tensor<f32> {
    x.matmul(w)
}

fn main() {}
