//! `deepinfer plot`: SVG pictures of `deepinfer bench` records.

use std::path::PathBuf;

use anyhow::bail;

use crate::bench::plot::{latest_per_point, pareto_svg, prefill_svg, read_records};

#[derive(Debug, clap::Args)]
pub struct PlotArgs {
    /// JSONL files written by `deepinfer bench --output`.
    #[arg(required = true)]
    pub records: Vec<PathBuf>,
    /// Folder for `pareto.svg` (decode records) and `prefill.svg` (prefill records).
    #[arg(long, short = 'o', default_value = ".")]
    pub out_dir: PathBuf,
    /// Plot records of different configurations together.
    #[arg(long)]
    pub compare: bool,
}

pub fn run(a: PlotArgs) -> anyhow::Result<()> {
    let records = latest_per_point(read_records(&a.records).map_err(anyhow::Error::msg)?);
    std::fs::create_dir_all(&a.out_dir)?;
    let mut wrote = Vec::new();
    if records.iter().any(|r| r.mode == "decode") {
        let p = a.out_dir.join("pareto.svg");
        pareto_svg(&records, &p, a.compare).map_err(anyhow::Error::msg)?;
        wrote.push(p);
    }
    if records.iter().any(|r| r.mode == "prefill") {
        let p = a.out_dir.join("prefill.svg");
        prefill_svg(&records, &p, a.compare).map_err(anyhow::Error::msg)?;
        wrote.push(p);
    }
    if wrote.is_empty() {
        bail!("no decode or prefill records in the input");
    }
    for p in wrote {
        eprintln!("deepinfer: wrote {}", p.display());
    }
    Ok(())
}
