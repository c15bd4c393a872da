//! A generated image task for convolutional models: small grey images of one of four shapes
//! (disc, square, triangle, cross) at a random position, size and brightness, with noise;
//! the label is the shape. Rendered procedurally from a seed, so nothing is downloaded and the
//! same seed always gives the same images (the CNN example's default task).

use crate::data::TensorDataset;
use crate::error::{Error, Result};
use crate::{Indices, Rng, Tensor};

/// The shapes, in label order.
pub const SHAPE_NAMES: [&str; 4] = ["disc", "square", "triangle", "cross"];

/// Sizes of the shapes task.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ShapesConfig {
    /// Image height and width in pixels (at least 12).
    pub size: usize,
    /// Training images.
    pub train: usize,
    /// Held-out images (drawn from their own seed: none is a training image).
    pub test: usize,
    /// Standard deviation of the Gaussian pixel noise.
    pub noise: f64,
    /// Seed of the whole task.
    pub seed: u64,
}

impl Default for ShapesConfig {
    fn default() -> Self {
        ShapesConfig { size: 16, train: 4096, test: 1024, noise: 0.5, seed: 7 }
    }
}

/// The generated images and labels: inputs `[N, 1, size, size]` (f32), labels `[N]`.
pub struct ShapesTask {
    config: ShapesConfig,
    train: TensorDataset<Tensor<f32>, Indices>,
    test: TensorDataset<Tensor<f32>, Indices>,
}

impl std::fmt::Debug for ShapesTask {
    /// The configuration and the set sizes (not the images).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShapesTask")
            .field("config", &self.config)
            .field("train", &crate::data::Dataset::len(&self.train))
            .field("test", &crate::data::Dataset::len(&self.test))
            .finish()
    }
}

impl ShapesTask {
    /// Renders the training and held-out sets; errors on sizes that cannot hold a shape.
    pub fn new(config: ShapesConfig) -> Result<Self> {
        let bad = |name: &'static str, detail: String| Err(Error::InvalidArgument { op: "ShapesConfig", name, detail });
        if config.size < 12 {
            return bad("size", format!("images need at least 12 pixels a side, got {}", config.size));
        }
        if config.train == 0 || config.test == 0 {
            return bad("train", format!("both sets need images, got train {} and test {}", config.train, config.test));
        }
        if !(config.noise >= 0.0 && config.noise.is_finite()) {
            return bad("noise", format!("must be finite and >= 0, got {}", config.noise));
        }
        let train = render(&config, config.train, config.seed)?;
        let test = render(&config, config.test, config.seed ^ 0x5eed_7e57_0000_0001)?;
        Ok(ShapesTask { config, train, test })
    }
    /// The configuration.
    pub fn config(&self) -> &ShapesConfig {
        &self.config
    }
    /// Number of classes (4).
    pub fn classes(&self) -> usize {
        SHAPE_NAMES.len()
    }
    /// The training images and labels.
    pub fn train_set(&self) -> TensorDataset<Tensor<f32>, Indices> {
        self.train.clone()
    }
    /// The held-out images and labels.
    pub fn test_set(&self) -> TensorDataset<Tensor<f32>, Indices> {
        self.test.clone()
    }
}

/// `n` images with balanced labels (label `i % 4` for image `i`).
fn render(c: &ShapesConfig, n: usize, seed: u64) -> Result<TensorDataset<Tensor<f32>, Indices>> {
    let s = c.size;
    let mut rng = Rng::seed(seed);
    let mut pixels = Vec::with_capacity(n * s * s);
    let mut labels = Vec::with_capacity(n);
    for i in 0..n {
        let label = i % SHAPE_NAMES.len();
        let r = 3.0 + rng.uniform() * (s as f64 / 2.0 - 4.0); // half-size in pixels
        // The centre keeps the shape one pixel off every border.
        let cy = r + 1.0 + rng.uniform() * (s as f64 - 2.0 * r - 2.0);
        let cx = r + 1.0 + rng.uniform() * (s as f64 - 2.0 * r - 2.0);
        let brightness = 0.6 + 0.4 * rng.uniform();
        for y in 0..s {
            for x in 0..s {
                let (dy, dx) = (y as f64 + 0.5 - cy, x as f64 + 0.5 - cx);
                let inside = match label {
                    0 => dx * dx + dy * dy <= r * r,
                    1 => dx.abs() <= 0.85 * r && dy.abs() <= 0.85 * r,
                    // Apex up: the width grows from 0 at the top to 2r at the bottom.
                    2 => dy.abs() <= r && dx.abs() <= 0.5 * (dy + r),
                    _ => {
                        let t = (r / 3.0).max(1.0);
                        (dx.abs() <= t && dy.abs() <= r) || (dy.abs() <= t && dx.abs() <= r)
                    }
                };
                let v = if inside { brightness } else { 0.0 };
                pixels.push((v + c.noise * rng.normal()) as f32);
            }
        }
        labels.push(label as i64);
    }
    TensorDataset::new(Tensor::from_vec(pixels, &[n, 1, s, s]), Indices::from_vec(labels, &[n]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Dataset;

    #[test]
    fn the_same_seed_gives_the_same_images_and_the_sets_differ() {
        let c = ShapesConfig { train: 64, test: 32, ..ShapesConfig::default() };
        let (a, b) = (ShapesTask::new(c.clone()).unwrap(), ShapesTask::new(c).unwrap());
        assert_eq!(a.train_set().tensors().0.to_vec(), b.train_set().tensors().0.to_vec());
        assert_eq!(a.train_set().len(), 64);
        assert_eq!(a.test_set().tensors().0.shape(), &[32, 1, 16, 16]);
        let first = |t: &ShapesTask, test: bool| {
            let set = if test { t.test_set() } else { t.train_set() };
            set.tensors().0.narrow(0, 0, 1).to_vec()
        };
        assert_ne!(first(&a, false), first(&a, true));
        let labels = a.train_set().tensors().1.as_slice().to_vec();
        assert_eq!(&labels[..8], &[0, 1, 2, 3, 0, 1, 2, 3]);
    }

    #[test]
    fn without_noise_each_image_is_one_lit_shape_of_one_brightness() {
        let c = ShapesConfig { size: 16, train: 200, test: 4, noise: 0.0, seed: 1 };
        let (x, _) = ShapesTask::new(c).unwrap().train_set().into_tensors();
        let v = x.to_vec();
        for img in v.chunks(256) {
            let lit: Vec<f32> = img.iter().copied().filter(|p| *p != 0.0).collect();
            assert!(lit.len() >= 9, "a shape covers at least 9 pixels, got {}", lit.len());
            assert!(lit.iter().all(|p| *p == lit[0] && (0.6..=1.0).contains(p)));
            // The border rows and columns stay dark: every shape fits inside the image.
            assert!((0..16).all(|i| img[i] == 0.0 && img[15 * 16 + i] == 0.0 && img[i * 16] == 0.0));
        }
    }

    #[test]
    fn bad_sizes_are_refused_naming_the_field() {
        let err = ShapesTask::new(ShapesConfig { size: 8, ..ShapesConfig::default() }).err().unwrap().to_string();
        assert!(err.contains("size") && err.contains('8'), "{err}");
    }
}
