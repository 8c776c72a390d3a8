//! `kiln plot run.jsonl [more.jsonl ...] -o curves.svg`: the curves of one or
//! several runs' `--log` files ([`super::runlog`]) as one SVG: the loss, the
//! throughput, and the evaluations where the logs have them, each run in its
//! own colour and named by its file.
//!
//! Invariants: every file is read and checked before anything is drawn (a
//! line that is not JSON, or a file with no step line, is an error naming the
//! file and line); the SVG is written atomically, so a failed plot leaves
//! whatever was at `-o` as it was.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};
use plotters::prelude::*;
use serde_json::Value;

#[derive(clap::Args)]
pub struct PlotArgs {
    /// The `--log` files of the runs to draw.
    #[arg(required = true)]
    pub logs: Vec<PathBuf>,
    /// Where to write the SVG.
    #[arg(short, long, value_name = "FILE")]
    pub out: PathBuf,
    /// Print one JSON object (runs, panels, the SVG's path and size).
    #[arg(long)]
    pub json: bool,
}

/// One run's points.
struct Run {
    name: String,
    loss: Vec<(f64, f64)>,
    throughput: Vec<(f64, f64)>,
    /// The throughput's unit (`tokens`, `examples`).
    unit: Option<String>,
    /// `(metric, points)` for each evaluation metric.
    evals: Vec<(String, Vec<(f64, f64)>)>,
}

/// The largest log `kiln plot` reads (a million steps is ~200 MB of lines).
const MAX_LOG_BYTES: u64 = 1 << 30;

fn read_run(path: &Path) -> anyhow::Result<Run> {
    let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if !meta.is_file() {
        bail!("{}: not a regular file", path.display());
    }
    if meta.len() > MAX_LOG_BYTES {
        bail!("{}: longer than the {MAX_LOG_BYTES}-byte limit of a log", path.display());
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let name = path.file_stem().map_or_else(|| path.display().to_string(), |s| s.to_string_lossy().into_owned());
    let mut run = Run { name, loss: Vec::new(), throughput: Vec::new(), unit: None, evals: Vec::new() };
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let at = || format!("{}:{}", path.display(), i + 1);
        let v: Value = serde_json::from_str(line).with_context(|| format!("{}: not a JSON object", at()))?;
        let step = v["step"].as_f64().with_context(|| format!("{}: no \"step\" number", at()))?;
        match v["kind"].as_str() {
            Some("step") => {
                if let Some(l) = v["loss"].as_f64() {
                    run.loss.push((step, l));
                }
                let obj = v.as_object().with_context(|| format!("{}: not a JSON object", at()))?;
                for (k, x) in obj {
                    if let (Some(unit), Some(x)) = (k.strip_suffix("_per_second"), x.as_f64()) {
                        run.unit.get_or_insert_with(|| unit.to_string());
                        run.throughput.push((step, x));
                    }
                }
            }
            Some("eval") => {
                let obj = v.as_object().with_context(|| format!("{}: not a JSON object", at()))?;
                for (k, x) in obj.iter().filter(|(k, _)| *k != "kind" && *k != "step") {
                    let Some(x) = x.as_f64() else { continue };
                    match run.evals.iter_mut().find(|(m, _)| m == k) {
                        Some((_, pts)) => pts.push((step, x)),
                        None => run.evals.push((k.clone(), vec![(step, x)])),
                    }
                }
            }
            other => bail!("{}: unknown line kind {other:?} (expected \"step\" or \"eval\")", at()),
        }
    }
    if run.loss.is_empty() {
        bail!("{}: no step line with a finite loss: not a `kiln train --log` file?", path.display());
    }
    Ok(run)
}

/// Each point's value replaced by the median of the `window` points ending at it.
fn running_median(points: &[(f64, f64)], window: usize) -> Vec<(f64, f64)> {
    (0..points.len())
        .map(|i| {
            let mut w: Vec<f64> = points[i.saturating_sub(window - 1)..=i].iter().map(|p| p.1).collect();
            w.sort_by(f64::total_cmp);
            (points[i].0, w[w.len() / 2])
        })
        .collect()
}

/// `lo..hi` of `values`, widened when they are all equal.
fn range(values: impl Iterator<Item = f64>) -> std::ops::Range<f64> {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| (lo.min(x), hi.max(x)));
    if !lo.is_finite() {
        return 0.0..1.0;
    }
    let pad = ((hi - lo) * 0.05).max(hi.abs() * 1e-3).max(1e-9);
    (lo - pad)..(hi + pad)
}

/// One run's line in a panel: its name, its colour's index and its points.
type Series<'a> = (&'a str, usize, &'a [(f64, f64)]);

type Panel<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// A tick label: whole numbers without a fraction, small ones with three
/// significant digits.
fn tick(v: &f64) -> String {
    if v.abs() >= 100.0 || *v == v.round() {
        format!("{v:.0}")
    } else {
        format!("{v:.3}").trim_end_matches('0').to_string()
    }
}

/// One panel over the steps `xs`: a line per run; with `marks`, a dot at
/// every point too (an evaluation may have one point only).
fn draw(
    area: &Panel<'_>,
    title: &str,
    y_desc: &str,
    series: &[Series<'_>],
    xs: std::ops::Range<f64>,
    marks: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let ys = range(series.iter().flat_map(|(_, _, p)| p.iter().map(|q| q.1)));
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(88)
        .build_cartesian_2d(xs, ys)?;
    chart.configure_mesh().x_desc("step").y_desc(y_desc).x_label_formatter(&tick).y_label_formatter(&tick).draw()?;
    for (name, colour, points) in series {
        let style = Palette99::pick(*colour).stroke_width(2);
        chart.draw_series(LineSeries::new(points.iter().copied(), style))?.label(*name).legend(move |(x, y)| {
            PathElement::new(vec![(x, y), (x + 18, y)], Palette99::pick(*colour).stroke_width(2))
        });
        if marks {
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, Palette99::pick(*colour).filled())))?;
        }
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    Ok(())
}

pub fn run(args: &PlotArgs) -> anyhow::Result<()> {
    let runs = args.logs.iter().map(|p| read_run(p)).collect::<anyhow::Result<Vec<_>>>()?;
    // Checked before drawing, so nothing is computed for a path that cannot be written.
    kiln::atomic_write::check_writable(&args.out).with_context(|| format!("-o {}", args.out.display()))?;
    let metrics: Vec<String> = {
        let mut m: Vec<String> = runs.iter().flat_map(|r| r.evals.iter().map(|(k, _)| k.clone())).collect();
        m.sort();
        m.dedup();
        m
    };
    let has_throughput = runs.iter().any(|r| !r.throughput.is_empty());
    let panels = 1 + usize::from(has_throughput) + metrics.len();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 320 * panels as u32)).into_drawing_area();
        let failed = |e: Box<dyn std::error::Error>| anyhow::anyhow!("drawing {}: {e}", args.out.display());
        root.fill(&WHITE).map_err(|e| failed(Box::new(e)))?;
        let areas = root.split_evenly((panels, 1));
        // Every panel over the same steps, so an evaluation lines up with the loss.
        let xs = range(runs.iter().flat_map(|r| r.loss.iter().map(|p| p.0)));
        let loss: Vec<_> = runs.iter().enumerate().map(|(i, r)| (r.name.as_str(), i, r.loss.as_slice())).collect();
        draw(&areas[0], "training loss", "loss", &loss, xs.clone(), false).map_err(failed)?;
        let mut next = 1;
        if has_throughput {
            let unit = runs.iter().find_map(|r| r.unit.clone()).unwrap_or_default();
            // Per-step rates of a pipelined loop scatter (a step's time is
            // measured from one completion to the next): a running median of
            // 15 steps shows the rate.
            let smooth: Vec<Vec<(f64, f64)>> = runs.iter().map(|r| running_median(&r.throughput, 15)).collect();
            let tp: Vec<_> =
                runs.iter().zip(&smooth).enumerate().map(|(i, (r, s))| (r.name.as_str(), i, s.as_slice())).collect();
            let title = "throughput (running median of 15 steps)";
            draw(&areas[next], title, &format!("{unit}/s"), &tp, xs.clone(), false).map_err(failed)?;
            next += 1;
        }
        for metric in &metrics {
            let pts: Vec<_> = runs
                .iter()
                .enumerate()
                .filter_map(|(i, r)| {
                    r.evals.iter().find(|(k, _)| k == metric).map(|(_, p)| (r.name.as_str(), i, p.as_slice()))
                })
                .collect();
            draw(&areas[next], &format!("evaluation: {metric}"), metric, &pts, xs.clone(), true).map_err(failed)?;
            next += 1;
        }
        root.present().map_err(|e| failed(Box::new(e)))?;
    }
    kiln::atomic_write::write_atomically(&args.out, svg.as_bytes())?;
    if args.json {
        let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
        let v = serde_json::json!({"runs": names, "panels": panels, "out": args.out, "bytes": svg.len()});
        println!("{v}");
    } else {
        println!("kiln plot: {} run(s), {} panel(s) -> {}", runs.len(), panels, args.out.display());
    }
    Ok(())
}
