//! train_utils: the metrics CSV (write, read back, resume), the PNG plot (a real, sized PNG
//! with text drawn from the embedded font), the progress line and the summary table.

use std::path::PathBuf;

use amp::train_utils::{MetricsRow, MetricsWriter, Progress, format_table, plot_metrics, read_metrics, status_line};

fn out_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("train_utils").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A run shaped like a real f16 one: loss falls, the scale grows every 100 clean steps and
/// halves on overflow; a few overflow steps are skipped with a non-finite loss and norm.
fn synthetic_run(steps: u64) -> Vec<MetricsRow> {
    let mut scale = 65536.0;
    let mut clean = 0;
    (1..=steps)
        .map(|step| {
            let skipped = step % 97 == 0 || step == 5 || step == 6;
            let row = MetricsRow {
                step,
                loss: if skipped {
                    f64::INFINITY
                } else {
                    2.6 * (-(step as f64) / 150.0).exp() + 0.02 * ((step * 7919 % 13) as f64 / 13.0) + 0.01
                },
                scale,
                skipped,
                grad_norm: if skipped { f64::NAN } else { 1.0 / (1.0 + step as f64 / 50.0) },
                lr: 1e-3,
                time_s: step as f64 * 0.05,
            };
            if skipped {
                scale /= 2.0;
                clean = 0;
            } else {
                clean += 1;
                if clean == 100 {
                    scale *= 2.0;
                    clean = 0;
                }
            }
            row
        })
        .collect()
}

#[test]
fn metrics_csv_round_trips_and_resume_drops_redone_steps() {
    let dir = out_dir("csv");
    let path = dir.join("metrics.csv");
    let rows = synthetic_run(300);
    let mut writer = MetricsWriter::create(&path).unwrap();
    for r in &rows {
        writer.write(r).unwrap();
    }
    writer.flush().unwrap();
    assert_eq!(writer.rows().len(), 300);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.starts_with("step,loss,scale,skipped,grad_norm,lr,time_s\n1,"));
    assert!(text.contains("\n5,inf,65536,1,NaN,0.001,0.25\n"), "{}", &text[..300]);

    let back = read_metrics(&path).unwrap();
    assert_eq!(back.len(), 300);
    for (a, b) in back.iter().zip(&rows) {
        assert_eq!(
            (a.step, a.loss, a.scale, a.skipped, a.lr, a.time_s),
            (b.step, b.loss, b.scale, b.skipped, b.lr, b.time_s)
        );
        assert!(a.grad_norm == b.grad_norm || (a.grad_norm.is_nan() && b.grad_norm.is_nan()));
    }
    drop(writer);

    // Resumed from a checkpoint at step 200: rows after it are dropped, new ones appended.
    let mut resumed = MetricsWriter::resume(&path, 200).unwrap();
    assert_eq!(resumed.rows().len(), 200);
    resumed.write(&rows[200]).unwrap();
    resumed.flush().unwrap();
    assert_eq!(read_metrics(&path).unwrap().len(), 201);

    // A file that is not a metrics log is refused with its name and line.
    std::fs::write(dir.join("bad.csv"), "step,loss,scale,skipped,grad_norm,lr,time_s\n1,2,3,4,5,6\n").unwrap();
    let err = read_metrics(dir.join("bad.csv")).unwrap_err().to_string();
    assert!(err.contains("bad.csv: line 2: 6 fields"), "{err}");
    let err = MetricsWriter::resume(dir.join("metrics.csv/nested"), 3).unwrap_err().to_string();
    assert!(err.contains("metrics.csv"), "{err}");
}

#[test]
fn plot_is_a_png_of_reasonable_size() {
    let dir = out_dir("plot");
    let path = dir.join("loss.png");
    plot_metrics(&path, &synthetic_run(600), "amp: tiny GPT, f16 + GradScaler").unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    assert_eq!(&bytes[12..16], b"IHDR");
    let width = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
    let height = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
    assert_eq!((width, height), (1200, 800));
    assert!(bytes.len() > 20_000 && bytes.len() < 3_000_000, "{} bytes", bytes.len());
    assert_eq!(&bytes[bytes.len() - 8..bytes.len() - 4], b"IEND");

    // Text is drawn: the same plot without its title is a different image.
    let untitled = dir.join("untitled.png");
    plot_metrics(&untitled, &synthetic_run(600), "").unwrap();
    assert_ne!(std::fs::read(&untitled).unwrap(), bytes);

    // Degenerate runs still plot: one step, a constant scale (bf16), all losses non-finite.
    let mut one = synthetic_run(1);
    one[0].scale = 1.0;
    plot_metrics(dir.join("one.png"), &one, "one step").unwrap();
    let mut broken = synthetic_run(20);
    broken.iter_mut().for_each(|r| r.loss = f64::NAN);
    plot_metrics(dir.join("nan.png"), &broken, "nan").unwrap();
    assert!(plot_metrics(dir.join("empty.png"), &[], "x").unwrap_err().to_string().contains("no metrics to plot"));
}

#[test]
fn progress_line_and_table() {
    let row = &synthetic_run(3)[2];
    assert_eq!(status_line(row, 2, 12_345.0), format!("loss {:.4} | scale 2^16 | skipped 2 | 12.3k tok/s", row.loss));
    let progress = Progress::hidden(10, 2);
    progress.update(row, 2, 1.0);
    progress.finish();
    assert!(progress.elapsed_s() >= 0.0);
    let table = format_table(&["", "f32", "f16"], &[vec!["step ms".into(), "12.5".into(), "3.1".into()]]);
    assert_eq!(table, "          f32  f16\n-------  ----  ---\nstep ms  12.5  3.1");
}
