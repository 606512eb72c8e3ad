//! SVG plots of benchmark records: the Pareto curve of per-user tok/s against tok/s per
//! device (decode), and prefill throughput against prompt length. A repeated point keeps its
//! latest record; records of different configurations are refused unless comparing is asked.

use std::collections::BTreeMap;
use std::path::Path;

use plotters::prelude::*;

use super::record::BenchRecord;

/// Reads JSONL records from files; a bad line is an error naming the file and line.
pub fn read_records(paths: &[impl AsRef<Path>]) -> Result<Vec<BenchRecord>, String> {
    let mut out = Vec::new();
    for p in paths {
        let records: Vec<BenchRecord> =
            crate::files::read_jsonl(p.as_ref(), "a bench record").map_err(|e| format!("{e:#}"))?;
        out.extend(records);
    }
    Ok(out)
}

/// One record per (configuration, batch, prompt length): the latest by timestamp, the later
/// line on a tie.
pub fn latest_per_point(records: Vec<BenchRecord>) -> Vec<BenchRecord> {
    let mut by_point: BTreeMap<(String, usize, usize), BenchRecord> = BTreeMap::new();
    for r in records {
        let key = (r.config_key(), r.batch, r.prompt_len);
        match by_point.get(&key) {
            Some(old) if old.timestamp > r.timestamp => {}
            _ => {
                by_point.insert(key, r);
            }
        }
    }
    by_point.into_values().collect()
}

/// Groups records by configuration; more than one group is an error unless `compare`.
pub fn series(
    records: &[BenchRecord],
    compare: bool,
) -> Result<BTreeMap<String, Vec<&BenchRecord>>, String> {
    let mut groups: BTreeMap<String, Vec<&BenchRecord>> = BTreeMap::new();
    for r in records {
        groups.entry(r.config_key()).or_default().push(r);
    }
    if groups.len() > 1 && !compare {
        let names: Vec<&str> = groups.keys().map(|k| k.as_str()).collect();
        return Err(format!(
            "records come from {} different configurations ({}); pass --compare to plot them together",
            groups.len(),
            names.join("; ")
        ));
    }
    Ok(groups)
}

/// The points not dominated in both coordinates (higher is better), sorted by x.
pub fn pareto_front(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let mut p: Vec<(f64, f64)> = points.to_vec();
    p.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.total_cmp(&a.1)));
    let mut front = Vec::new();
    let mut best_y = f64::NEG_INFINITY;
    for (x, y) in p {
        if y > best_y {
            front.push((x, y));
            best_y = y;
        }
    }
    front.reverse();
    front
}

/// One plotted series: its name, its points, whether they are joined by a line, its colour.
type Series = (String, Vec<(f64, f64)>, bool, usize);

fn draw(
    path: &Path,
    title: &str,
    (x_label, y_label): (&str, &str),
    groups: &[Series],
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("drawing {}: {e}", path.display());
    let all: Vec<(f64, f64)> = groups.iter().flat_map(|g| g.1.iter().copied()).collect();
    if all.is_empty() {
        return Err(format!("no points to plot for {}", path.display()));
    }
    let xmax = all.iter().map(|p| p.0).fold(0.0, f64::max) * 1.1 + 1e-9;
    let ymax = all.iter().map(|p| p.1).fold(0.0, f64::max) * 1.1 + 1e-9;
    let root = SVGBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(20)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..xmax, 0.0..ymax)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()
        .map_err(|e| err(&e))?;
    for (name, pts, line, color) in groups {
        let color = Palette99::pick(*color).to_rgba();
        if *line {
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}

/// Decode records -> Pareto SVG (per-user tok/s on x, tok/s per device on y).
pub fn pareto_svg(records: &[BenchRecord], path: &Path, compare: bool) -> Result<(), String> {
    let decode: Vec<BenchRecord> = records
        .iter()
        .filter(|r| r.mode == "decode")
        .cloned()
        .collect();
    let groups = series(&decode, compare)?;
    let mut drawn = Vec::new();
    for (i, (name, rs)) in groups.into_iter().enumerate() {
        let pts: Vec<(f64, f64)> = rs
            .iter()
            .filter_map(|r| Some((r.tok_s_per_user?, r.tok_s_per_device?)))
            .collect();
        drawn.push((format!("{name} (front)"), pareto_front(&pts), true, i));
        drawn.push((name, pts, false, i));
    }
    draw(
        path,
        "Decode: per-user vs per-device throughput",
        ("tok/s per user", "tok/s per device"),
        &drawn,
    )
}

/// Prefill records -> SVG of prefill tok/s against prompt length.
pub fn prefill_svg(records: &[BenchRecord], path: &Path, compare: bool) -> Result<(), String> {
    let prefill: Vec<BenchRecord> = records
        .iter()
        .filter(|r| r.mode == "prefill")
        .cloned()
        .collect();
    let groups = series(&prefill, compare)?;
    let drawn: Vec<_> = groups
        .into_iter()
        .enumerate()
        .map(|(i, (name, rs))| {
            let mut pts: Vec<(f64, f64)> = rs
                .iter()
                .filter_map(|r| Some((r.prompt_len as f64, r.prefill_tok_s?)))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            (name, pts, true, i)
        })
        .collect();
    draw(
        path,
        "Prefill throughput",
        ("prompt tokens", "prefill tok/s per device"),
        &drawn,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(
        mode: &str,
        engine: &str,
        batch: usize,
        len: usize,
        median: f64,
        ts: u64,
    ) -> BenchRecord {
        let mut r: BenchRecord = serde_json::from_value(serde_json::json!({
            "mode": mode, "engine": engine, "model": "m", "device": "cpu", "threads": 2, "batch": batch,
            "prompt_len": len, "new_tokens": 8, "warmup": 1, "commit": "x", "raw_s": [median],
            "median_s": 0.0, "timestamp": ts
        }))
        .unwrap();
        r.derive();
        r
    }

    #[test]
    fn latest_record_wins_for_a_repeated_point() {
        let recs = vec![
            rec("decode", "a", 1, 8, 0.1, 5),
            rec("decode", "a", 1, 8, 0.2, 9),
            rec("decode", "a", 1, 8, 0.4, 7),
        ];
        let kept = latest_per_point(recs);
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].median_s, 0.2);
    }

    #[test]
    fn mixed_configurations_are_refused_unless_compared() {
        let recs = vec![
            rec("decode", "a", 1, 8, 0.1, 1),
            rec("decode", "b", 1, 8, 0.1, 1),
        ];
        let e = series(&recs, false).unwrap_err();
        assert!(e.contains("--compare"), "{e}");
        assert_eq!(series(&recs, true).unwrap().len(), 2);
    }

    #[test]
    fn pareto_front_drops_dominated_points() {
        let f = pareto_front(&[(1.0, 10.0), (2.0, 8.0), (1.5, 7.0), (3.0, 2.0), (0.5, 9.0)]);
        assert_eq!(f, vec![(1.0, 10.0), (2.0, 8.0), (3.0, 2.0)]);
    }

    #[test]
    fn svgs_are_written_with_points_and_labels() {
        let dir = tempfile::tempdir().unwrap();
        let recs = vec![
            rec("decode", "a", 1, 8, 0.01, 1),
            rec("decode", "a", 8, 8, 0.02, 1),
            rec("prefill", "a", 1, 128, 0.5, 1),
            rec("prefill", "a", 1, 512, 1.5, 1),
        ];
        let p = dir.path().join("pareto.svg");
        pareto_svg(&recs, &p, false).unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        assert!(
            svg.starts_with("<svg")
                && svg.contains("tok/s per device")
                && svg.matches("<circle").count() >= 2
        );
        let p2 = dir.path().join("prefill.svg");
        prefill_svg(&recs, &p2, false).unwrap();
        assert!(std::fs::read_to_string(&p2).unwrap().contains("<polyline"));
    }
}
