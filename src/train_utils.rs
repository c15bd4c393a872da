//! Helpers for training programs: a CSV metrics log, a PNG plot of loss and loss scale with
//! skipped steps marked, a progress bar, and a plain-text summary table.
//!
//! ```no_run
//! use amp::train_utils::{MetricsRow, MetricsWriter, Progress, plot_metrics};
//! # fn main() -> amp::Result<()> {
//! let mut metrics = MetricsWriter::create("runs/demo/metrics.csv")?;
//! let progress = Progress::new(100, 0);
//! for step in 1..=100 {
//!     let row = MetricsRow { step, loss: 1.0 / step as f64, scale: 65536.0, skipped: false,
//!                            grad_norm: 0.5, lr: 1e-3, time_s: step as f64 * 0.01 };
//!     metrics.write(&row)?;
//!     progress.update(&row, 0, 12_000.0);
//! }
//! progress.finish();
//! plot_metrics("runs/demo/loss.png", metrics.rows(), "demo")?;
//! # Ok(()) }
//! ```
//!
//! Design notes: the plot draws its text with DejaVu Sans embedded in the binary (the `dejavu`
//! crate, through plotters' `ab_glyph` backend), so it needs no system font libraries and
//! renders the same everywhere.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use amp_core::{Error, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use plotters::prelude::*;

// ---- metrics CSV ---------------------------------------------------------------------------

/// One optimizer step's numbers, as logged.
#[derive(Clone, Debug, PartialEq)]
pub struct MetricsRow {
    /// Step number (1-based: the step just taken).
    pub step: u64,
    /// Training loss of the step (unscaled; may be non-finite on a skipped step).
    pub loss: f64,
    /// Loss scale used for the step (1 for f32/bf16).
    pub scale: f64,
    /// Whether the optimizer step was skipped (non-finite gradients).
    pub skipped: bool,
    /// Global L2 norm of the unscaled gradients (NaN or inf when the step was skipped).
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Seconds since the run (or the resumed run) started.
    pub time_s: f64,
}

/// The CSV header, in column order.
pub const METRICS_HEADER: &str = "step,loss,scale,skipped,grad_norm,lr,time_s";

impl MetricsRow {
    fn to_csv(&self) -> String {
        format!(
            "{},{},{},{},{},{},{}",
            self.step,
            self.loss,
            self.scale,
            u8::from(self.skipped),
            self.grad_norm,
            self.lr,
            self.time_s
        )
    }
    fn from_csv(line: &str) -> std::result::Result<Self, String> {
        let fields: Vec<&str> = line.trim().split(',').collect();
        if fields.len() != 7 {
            return Err(format!("{} fields, expected 7 ({METRICS_HEADER})", fields.len()));
        }
        let num = |i: usize, name: &str| fields[i].parse::<f64>().map_err(|e| format!("{name} `{}`: {e}", fields[i]));
        Ok(MetricsRow {
            step: fields[0].parse().map_err(|e| format!("step `{}`: {e}", fields[0]))?,
            loss: num(1, "loss")?,
            scale: num(2, "scale")?,
            skipped: match fields[3] {
                "0" => false,
                "1" => true,
                other => return Err(format!("skipped `{other}`: expected 0 or 1")),
            },
            grad_norm: num(4, "grad_norm")?,
            lr: num(5, "lr")?,
            time_s: num(6, "time_s")?,
        })
    }
}

fn io_err(path: &Path, what: &str, e: impl std::fmt::Display) -> Error {
    Error::Io { path: path.display().to_string(), detail: format!("{what}: {e}") }
}

/// Reads a metrics CSV written by [`MetricsWriter`]; errors name the file and line.
pub fn read_metrics(path: impl AsRef<Path>) -> Result<Vec<MetricsRow>> {
    let path = path.as_ref();
    let file = File::open(path).map_err(|e| io_err(path, "cannot read the metrics", e))?;
    let mut rows = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| io_err(path, "cannot read the metrics", e))?;
        if i == 0 {
            if line.trim() != METRICS_HEADER {
                return Err(io_err(
                    path,
                    "not a metrics file",
                    format!("line 1 is `{line}`, expected `{METRICS_HEADER}`"),
                ));
            }
            continue;
        }
        if line.trim().is_empty() {
            continue;
        }
        rows.push(MetricsRow::from_csv(&line).map_err(|e| io_err(path, &format!("line {}", i + 1), e))?);
    }
    Ok(rows)
}

/// The rows of a metrics file with `step <= up_to`, for a resume: a torn last line (no
/// newline: the writer was killed mid-row) is dropped, later rows are ignored unparsed.
fn read_metrics_up_to(path: &Path, up_to: u64) -> Result<Vec<MetricsRow>> {
    let text = std::fs::read_to_string(path).map_err(|e| io_err(path, "cannot read the metrics", e))?;
    let complete = match text.rfind('\n') {
        Some(i) => &text[..=i],
        None => "",
    };
    let mut lines = complete.lines().enumerate();
    match lines.next() {
        Some((_, h)) if h.trim() == METRICS_HEADER => {}
        None => return Ok(Vec::new()), // killed before the header reached the disk
        Some((_, h)) => {
            return Err(io_err(path, "not a metrics file", format!("line 1 is `{h}`, expected `{METRICS_HEADER}`")));
        }
    }
    let mut rows = Vec::new();
    for (i, line) in lines {
        if line.trim().is_empty() {
            continue;
        }
        let row = MetricsRow::from_csv(line).map_err(|e| io_err(path, &format!("line {}", i + 1), e))?;
        if row.step > up_to {
            break;
        }
        rows.push(row);
    }
    Ok(rows)
}

/// Writes [`MetricsRow`]s as CSV (header [`METRICS_HEADER`]), and keeps them for plotting.
#[derive(Debug)]
pub struct MetricsWriter {
    out: BufWriter<File>,
    path: PathBuf,
    rows: Vec<MetricsRow>,
}

impl MetricsWriter {
    /// A new metrics file at `path` (parent directories created; an old file is replaced).
    pub fn create(path: impl AsRef<Path>) -> Result<Self> {
        Self::with_rows(path.as_ref(), Vec::new())
    }
    /// Continues the metrics file of a run resumed after `step`: keeps its rows up to `step`,
    /// drops later ones (those steps are about to be redone), and appends from there. A
    /// missing file starts empty. A torn last line (a process killed while the row was being
    /// written) is dropped; every complete line up to `step` must parse. The kept rows are
    /// rewritten atomically (temp file, fsync, rename), so a crash during the resume itself
    /// loses nothing.
    pub fn resume(path: impl AsRef<Path>, step: u64) -> Result<Self> {
        let path = path.as_ref();
        let rows = if path.exists() { read_metrics_up_to(path, step)? } else { Vec::new() };
        Self::with_rows(path, rows)
    }
    fn with_rows(path: &Path, rows: Vec<MetricsRow>) -> Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| io_err(dir, "cannot create the directory", e))?;
        }
        let mut text = format!("{METRICS_HEADER}\n");
        for r in &rows {
            text.push_str(&r.to_csv());
            text.push('\n');
        }
        amp_core::checkpoint::write_atomic(path, text.as_bytes())?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(|e| io_err(path, "cannot open the metrics file", e))?;
        Ok(MetricsWriter { out: BufWriter::new(file), path: path.to_path_buf(), rows })
    }
    /// Appends a row (buffered: see [`MetricsWriter::flush`] and [`MetricsWriter::sync`]).
    pub fn write(&mut self, row: &MetricsRow) -> Result<()> {
        writeln!(self.out, "{}", row.to_csv()).map_err(|e| io_err(&self.path, "cannot write the metrics", e))?;
        self.rows.push(row.clone());
        Ok(())
    }
    /// Pushes buffered rows to the file (the operating system's cache).
    pub fn flush(&mut self) -> Result<()> {
        self.out.flush().map_err(|e| io_err(&self.path, "cannot write the metrics", e))
    }
    /// Pushes buffered rows to the file and the file to disk (fsync): every row written so far
    /// survives a crash or power cut. A trainer calls it before each checkpoint, so the rows up
    /// to a checkpoint are durable when the checkpoint is.
    pub fn sync(&mut self) -> Result<()> {
        self.flush()?;
        self.out.get_ref().sync_data().map_err(|e| io_err(&self.path, "cannot fsync the metrics", e))
    }
    /// Every row so far (including those kept by [`MetricsWriter::resume`]).
    pub fn rows(&self) -> &[MetricsRow] {
        &self.rows
    }
    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for MetricsWriter {
    fn drop(&mut self) {
        let _ = self.out.flush(); // explicit flush() reports errors; dropping cannot
    }
}

// ---- plot -----------------------------------------------------------------------------------

/// Registers the embedded DejaVu Sans as plotters' "sans-serif" (once per process).
fn register_fonts() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        // The bytes are a valid TTF shipped by the dejavu crate; a failure would only mean no
        // text in plots, which the PNG test would catch.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
        let _ = plotters::style::register_font("sans-serif", FontStyle::Bold, dejavu::sans::bold());
    });
}

/// Centred moving average over `window` points (smoothing for the loss curve, without the lag
/// of an exponential average).
fn moving_average(points: &[(f64, f64)], window: usize) -> Vec<(f64, f64)> {
    let half = window / 2;
    let mut prefix = vec![0.0];
    for p in points {
        prefix.push(prefix.last().copied().unwrap_or(0.0) + p.1);
    }
    (0..points.len())
        .map(|i| {
            let (lo, hi) = (i.saturating_sub(half), (i + half + 1).min(points.len()));
            (points[i].0, (prefix[hi] - prefix[lo]) / (hi - lo) as f64)
        })
        .collect()
}

/// A log-axis range covering `values` (all positive), widened to whole powers of `base` with
/// some headroom, so the axis always has labelled ticks (even for one value).
fn log_range(values: impl Iterator<Item = f64>, base: f64) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !lo.is_finite() || hi <= 0.0 {
        return (1.0 / base, base);
    }
    let log = |v: f64| v.ln() / base.ln();
    (base.powf((log(lo) - 0.25).floor()), base.powf((log(hi) + 0.25).ceil()))
}

/// Draws `rows` as a PNG at `path` (1200×800): the loss (raw and smoothed, log axis) above,
/// the loss scale (log axis) below, skipped steps marked in red in both panels.
pub fn plot_metrics(path: impl AsRef<Path>, rows: &[MetricsRow], title: &str) -> Result<()> {
    let path = path.as_ref();
    if rows.is_empty() {
        return Err(Error::InvalidArgument {
            op: "plot_metrics",
            name: "rows",
            detail: format!("no metrics to plot into {}", path.display()),
        });
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| io_err(dir, "cannot create the directory", e))?;
    }
    register_fonts();
    draw(path, rows, title).map_err(|e| io_err(path, "cannot draw the plot", e))
}

fn draw(path: &Path, rows: &[MetricsRow], title: &str) -> std::result::Result<(), Box<dyn std::error::Error>> {
    let root = BitMapBackend::new(path, (1200, 800)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 26).into_font().style(FontStyle::Bold))?;
    let (top, bottom) = root.split_vertically(440);

    let first = rows.iter().map(|r| r.step).min().unwrap_or(0) as f64;
    let last = rows.iter().map(|r| r.step).max().unwrap_or(1) as f64;
    let x_range = first..last.max(first + 1.0);
    // Whole steps only: no more x labels than steps in the range.
    let x_labels = ((x_range.end - x_range.start) as usize + 1).min(10);
    let skipped: Vec<&MetricsRow> = rows.iter().filter(|r| r.skipped).collect();
    let red = RGBColor(214, 39, 40);
    let blue = RGBColor(31, 119, 180);

    // Loss panel: finite, positive losses on a log axis.
    let losses: Vec<(f64, f64)> =
        rows.iter().filter(|r| r.loss.is_finite() && r.loss > 0.0).map(|r| (r.step as f64, r.loss)).collect();
    let (lo, hi) = log_range(losses.iter().map(|p| p.1), 10.0);
    let mut chart = ChartBuilder::on(&top)
        .margin(12)
        .caption("training loss", ("sans-serif", 20))
        .x_label_area_size(36)
        .y_label_area_size(70)
        .build_cartesian_2d(x_range.clone(), (lo..hi).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss (log)")
        .label_style(("sans-serif", 14))
        .x_labels(x_labels)
        .x_label_formatter(&|v| format!("{v:.0}"))
        .draw()?;
    chart
        .draw_series(LineSeries::new(losses.clone(), blue.mix(0.3)))?
        .label("loss")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], blue.mix(0.3)));
    if losses.len() <= 60 {
        // Few steps: show each one, a line alone would hide a single point.
        chart.draw_series(losses.iter().map(|&p| Circle::new(p, 3, blue.filled())))?;
    }
    let window = (losses.len() / 40).max(1);
    chart
        .draw_series(LineSeries::new(moving_average(&losses, window), blue.stroke_width(2)))?
        .label("loss, smoothed")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], blue.stroke_width(2)));
    if !skipped.is_empty() {
        // Skipped steps often have no finite loss: mark them along the bottom of the panel.
        chart
            .draw_series(skipped.iter().map(|r| TriangleMarker::new((r.step as f64, lo * 1.15), 6, red.filled())))?
            .label(format!("skipped step ({})", skipped.len()))
            .legend(move |(x, y)| TriangleMarker::new((x + 10, y), 6, red.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .draw()?;

    // Scale panel: the loss scale on a log axis (powers of two read off directly).
    let scales: Vec<(f64, f64)> =
        rows.iter().filter(|r| r.scale.is_finite() && r.scale > 0.0).map(|r| (r.step as f64, r.scale)).collect();
    let (lo, hi) = log_range(scales.iter().map(|p| p.1), 2.0);
    let mut chart = ChartBuilder::on(&bottom)
        .margin(12)
        .caption("loss scale", ("sans-serif", 20))
        .x_label_area_size(36)
        .y_label_area_size(70)
        .build_cartesian_2d(x_range, (lo..hi).log_scale().base(2.0))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("scale (log)")
        .label_style(("sans-serif", 14))
        .x_labels(x_labels)
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format_scale(*v))
        .draw()?;
    chart
        .draw_series(LineSeries::new(scales, RGBColor(44, 160, 44).stroke_width(2)))?
        .label("loss scale")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RGBColor(44, 160, 44).stroke_width(2)));
    if !skipped.is_empty() {
        chart
            .draw_series(
                skipped
                    .iter()
                    .filter(|r| r.scale.is_finite() && r.scale > 0.0)
                    .map(|r| Cross::new((r.step as f64, r.scale), 6, red.stroke_width(2))),
            )?
            .label("skipped step (scale before halving)")
            .legend(move |(x, y)| Cross::new((x + 10, y), 6, red.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .draw()?;
    root.present()?;
    Ok(())
}

/// `65536` as `2^16`, other values compactly.
fn format_scale(v: f64) -> String {
    let log2 = v.log2();
    if (log2 - log2.round()).abs() < 1e-9 {
        format!("2^{}", log2.round() as i64)
    } else if !(1e-2..1e4).contains(&v) {
        format!("{v:.1e}")
    } else {
        format!("{v:.3}")
    }
}

// ---- progress -------------------------------------------------------------------------------

/// A progress bar for a training loop: step, loss, loss scale, skipped steps, tokens/s. Draws
/// on stderr when it is a terminal, and stays silent otherwise (logs, CI).
#[derive(Debug)]
pub struct Progress {
    bar: ProgressBar,
    started: Instant,
}

impl Progress {
    /// A bar for steps `start_step + 1 ..= total_steps`.
    pub fn new(total_steps: u64, start_step: u64) -> Self {
        Self::with_target(total_steps, start_step, ProgressDrawTarget::stderr())
    }
    /// A bar that draws nothing (tests, `--quiet`).
    pub fn hidden(total_steps: u64, start_step: u64) -> Self {
        Self::with_target(total_steps, start_step, ProgressDrawTarget::hidden())
    }
    fn with_target(total_steps: u64, start_step: u64, target: ProgressDrawTarget) -> Self {
        let bar = ProgressBar::with_draw_target(Some(total_steps), target);
        let style =
            ProgressStyle::with_template("{elapsed_precise:.dim} [{bar:30.cyan/blue}] {pos}/{len} {msg} (eta {eta})")
                .expect("a valid template")
                .progress_chars("=> ");
        bar.set_style(style);
        bar.set_position(start_step);
        Progress { bar, started: Instant::now() }
    }
    /// Shows the step just taken.
    pub fn update(&self, row: &MetricsRow, skipped_total: u64, tokens_per_s: f64) {
        self.bar.set_position(row.step);
        self.bar.set_message(status_line(row, skipped_total, tokens_per_s));
    }
    /// Prints a line above the bar (or plainly, when the bar is not drawn).
    pub fn println(&self, line: impl AsRef<str>) {
        if self.bar.is_hidden() {
            eprintln!("{}", line.as_ref());
        } else {
            self.bar.println(line);
        }
    }
    /// Leaves the bar at its last state.
    pub fn finish(&self) {
        self.bar.finish();
    }
    /// Seconds since the bar was made.
    pub fn elapsed_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }
}

/// `loss 1.2345 | scale 2^16 | skipped 3 | 12.3k tok/s`, the bar's message (also useful for
/// plain log lines).
pub fn status_line(row: &MetricsRow, skipped_total: u64, tokens_per_s: f64) -> String {
    let tps = if tokens_per_s >= 1e6 {
        format!("{:.2}M", tokens_per_s / 1e6)
    } else if tokens_per_s >= 1e3 {
        format!("{:.1}k", tokens_per_s / 1e3)
    } else {
        format!("{tokens_per_s:.0}")
    };
    format!("loss {:.4} | scale {} | skipped {skipped_total} | {tps} tok/s", row.loss, format_scale(row.scale))
}

// ---- summary table --------------------------------------------------------------------------

/// A plain-text table: a header row, a rule, and the rows, columns padded to their widest
/// cell (first column left-aligned, the others right-aligned, as numbers read best).
pub fn format_table(header: &[&str], rows: &[Vec<String>]) -> String {
    let cols = header.len();
    let mut width: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate().take(cols) {
            width[i] = width[i].max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| -> String {
        let parts: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| if i == 0 { format!("{c:<w$}", w = width[i]) } else { format!("{c:>w$}", w = width[i]) })
            .collect();
        parts.join("  ").trim_end().to_string()
    };
    let mut out = line(header.to_vec());
    out.push('\n');
    out.push_str(&width.iter().map(|&w| "-".repeat(w)).collect::<Vec<_>>().join("  "));
    for row in rows {
        out.push('\n');
        out.push_str(&line((0..cols).map(|i| row.get(i).map_or("", String::as_str)).collect()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_rows_round_trip_including_non_finite() {
        let row = MetricsRow {
            step: 7,
            loss: f64::INFINITY,
            scale: 32768.0,
            skipped: true,
            grad_norm: f64::NAN,
            lr: 3e-4,
            time_s: 0.125,
        };
        let back = MetricsRow::from_csv(&row.to_csv()).unwrap();
        assert_eq!((back.step, back.loss, back.scale, back.skipped, back.lr), (7, f64::INFINITY, 32768.0, true, 3e-4));
        assert!(back.grad_norm.is_nan());
        assert!(MetricsRow::from_csv("1,2,3").unwrap_err().contains("3 fields"));
        assert!(MetricsRow::from_csv("1,2,3,yes,5,6,7").unwrap_err().contains("skipped `yes`"));
    }

    #[test]
    fn embedded_font_measures_text() {
        register_fonts();
        let (w, h) = ("sans-serif", 20).into_font().box_size("loss scale").expect("the embedded font is registered");
        assert!(w > 50 && h > 10, "{w}x{h}");
    }

    #[test]
    fn scale_labels_and_table() {
        assert_eq!(format_scale(65536.0), "2^16");
        assert_eq!(format_scale(1.0), "2^0");
        assert_eq!(format_scale(0.5), "2^-1");
        assert_eq!(format_scale(0.3), "0.300");
        assert_eq!(format_scale(123_456.0), "1.2e5");
        let t = format_table(
            &["precision", "loss"],
            &[vec!["f16".into(), "0.0123".into()], vec!["bf16".into(), "1.5".into()]],
        );
        assert_eq!(t, "precision    loss\n---------  ------\nf16        0.0123\nbf16          1.5");
    }
}
