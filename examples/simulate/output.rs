//! Tables, JSON lines and plots of the `simulate` example.

use kvtrie::sim::{Ceiling, Report, RouterSetup, SimConfig};

fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

pub(crate) fn json_number(x: f64) -> String {
    if x != 0.0 && x.abs() < 1e-3 {
        // Six decimals would print a small setting (a temperature of 1e-7) as 0.
        format!("{x:e}")
    } else if x.is_finite() {
        format!("{x:.6}")
    } else {
        "null".into()
    }
}

fn json_source(cfg: &SimConfig, trace: Option<&str>) -> String {
    match trace {
        Some(p) => format!(
            "\"trace\":{},\"time_scale\":{},\"trace_block_tokens\":{},\"seed\":{}",
            json_string(p),
            json_number(cfg.time_scale),
            cfg.trace_block_tokens,
            cfg.seed
        ),
        None => format!(
            "\"trace\":null,\"rate\":{},\"seed\":{}",
            json_number(cfg.rate),
            cfg.seed
        ),
    }
}

/// One JSON object for a policy's run.
pub fn to_json(
    r: &Report,
    cfg: &SimConfig,
    trace: Option<&str>,
    setup: Option<RouterSetup>,
) -> String {
    let per_replica: Vec<String> = r.per_replica.iter().map(u64::to_string).collect();
    let setup = setup.unwrap_or_else(RouterSetup::single);
    format!(
        "{{\"policy\":{},{},\"replicas\":{},\"cache_blocks\":{},\"routers\":{},\"shared\":{},\
         \"kv_overlap_weight\":{},\"kv_temperature\":{},\"requests\":{},\"prompt_tokens\":{},\
         \"cached_tokens\":{},\"hit_rate\":{},\"ttft_mean_ms\":{},\"ttft_p50_ms\":{},\
         \"ttft_p99_ms\":{},\"load_balance\":{},\"per_replica\":[{}],\"makespan_s\":{},\
         \"kv_events\":{},\"route_seconds\":{},\"decisions_per_sec\":{}}}",
        json_string(&r.policy),
        json_source(cfg, trace),
        cfg.replicas,
        cfg.cache_blocks,
        setup.instances,
        setup.shared,
        json_number(cfg.kv_overlap_weight),
        json_number(cfg.kv_temperature),
        r.requests,
        r.prompt_tokens,
        r.cached_tokens,
        json_number(r.hit_rate()),
        json_number(r.ttft_mean_ms),
        json_number(r.ttft_p50_ms),
        json_number(r.ttft_p99_ms),
        json_number(r.load_balance()),
        per_replica.join(","),
        json_number(r.makespan_s),
        r.kv_events,
        json_number(r.route_time.as_secs_f64()),
        json_number(r.decisions_per_sec()),
    )
}

/// One JSON object for the infinite-cache ceiling.
pub fn ceiling_json(c: &Ceiling, cfg: &SimConfig, trace: Option<&str>) -> String {
    format!(
        "{{\"policy\":\"infinite-cache ceiling\",{},\"prompt_tokens\":{},\"cached_tokens\":{},\
         \"hit_rate\":{}}}",
        json_source(cfg, trace),
        c.prompt_tokens,
        c.cached_tokens,
        json_number(c.hit_rate())
    )
}

fn human_rate(x: f64) -> String {
    if !x.is_finite() {
        "-".into()
    } else if x >= 1e6 {
        format!("{:.2} M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1} k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

const CEILING: &str = "infinite-cache ceiling";

/// The per-policy table, closed by the ceiling row.
pub fn print_table(reports: &[Report], ceiling: &Ceiling) {
    let w = reports
        .iter()
        .map(|r| r.policy.len())
        .chain([CEILING.len()])
        .max()
        .unwrap_or(6);
    outln!(
        "{:<w$}  {:>8}  {:>10}  {:>10}  {:>10}  {:>8}  {:>12}",
        "policy",
        "hit rate",
        "TTFT mean",
        "TTFT p50",
        "TTFT p99",
        "balance",
        "decisions/s"
    );
    outln!("{}", "-".repeat(w + 2 + 8 + 3 * 12 + 2 + 8 + 2 + 12));
    for r in reports {
        outln!(
            "{:<w$}  {:>7.1}%  {:>7.0} ms  {:>7.0} ms  {:>7.0} ms  {:>8.2}  {:>12}",
            r.policy,
            100.0 * r.hit_rate(),
            r.ttft_mean_ms,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.load_balance(),
            human_rate(r.decisions_per_sec()),
        );
    }
    outln!(
        "{:<w$}  {:>7.1}%  {:>10}  {:>10}  {:>10}  {:>8}  {:>12}",
        CEILING,
        100.0 * ceiling.hit_rate(),
        "-",
        "-",
        "-",
        "-",
        "-"
    );
}

fn find<'a>(reports: &'a [Report], prefix: &str) -> Option<&'a Report> {
    reports.iter().find(|r| r.policy.starts_with(prefix))
}

/// The several-routers table: one row per (instances, mode, router), with the single
/// oracle and the ceiling as references.
pub fn print_multi(multi: &[(RouterSetup, Report)], reports: &[Report], ceiling: &Ceiling) {
    outln!("several router instances (request i → instance i mod K):");
    outln!();
    let w = multi
        .iter()
        .map(|(_, r)| r.policy.len())
        .max()
        .unwrap_or(6)
        .max(CEILING.len());
    outln!(
        "{:<12}  {:<w$}  {:>8}  {:>10}  {:>10}  {:>10}  {:>8}",
        "routers",
        "policy",
        "hit rate",
        "TTFT mean",
        "TTFT p50",
        "TTFT p99",
        "balance"
    );
    outln!("{}", "-".repeat(12 + 2 + w + 2 + 8 + 3 * 12 + 2 + 8));
    let row = |label: &str, r: &Report| {
        outln!(
            "{:<12}  {:<w$}  {:>7.1}%  {:>7.0} ms  {:>7.0} ms  {:>7.0} ms  {:>8.2}",
            label,
            r.policy,
            100.0 * r.hit_rate(),
            r.ttft_mean_ms,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.load_balance(),
        );
    };
    for (setup, r) in multi {
        row(&setup.label(), r);
    }
    if let Some(o) = find(reports, "oracle") {
        row("-", o);
    }
    outln!(
        "{:<12}  {:<w$}  {:>7.1}%",
        "-",
        CEILING,
        100.0 * ceiling.hit_rate()
    );
}

/// The KV-aware sweep, with the references it is measured against.
pub fn print_sweep(sweep: &[(f64, f64, Report)], reports: &[Report], cfg: &SimConfig) {
    let oracle = find(reports, "oracle").map_or(0.0, Report::hit_rate);
    // "n/a" where the oracle hit nothing (or did not run): never NaN or inf.
    let vs_oracle = |r: &Report| {
        if oracle > 0.0 {
            format!("{:.3}", r.hit_rate() / oracle)
        } else {
            "n/a".to_string()
        }
    };
    outln!(
        "KV-aware sweep (overlap weight × temperature; default {} × {}):",
        cfg.kv_overlap_weight,
        cfg.kv_temperature
    );
    outln!();
    outln!(
        "{:>6}  {:>5}  {:>8}  {:>8}  {:>10}  {:>10}  {:>8}",
        "weight",
        "temp",
        "hit rate",
        "÷ oracle",
        "TTFT mean",
        "TTFT p99",
        "balance"
    );
    outln!("{}", "-".repeat(6 + 2 + 5 + 2 + 8 + 2 + 8 + 2 * 12 + 2 + 8));
    for (w, t, r) in sweep {
        outln!(
            "{:>6}  {:>5}  {:>7.1}%  {:>8}  {:>7.0} ms  {:>7.0} ms  {:>8.2}",
            w,
            t,
            100.0 * r.hit_rate(),
            vs_oracle(r),
            r.ttft_mean_ms,
            r.ttft_p99_ms,
            r.load_balance()
        );
    }
    for (name, label) in [
        ("round-robin", "round-robin"),
        ("prefix-affinity (ray)", "affinity/ray"),
        ("oracle", "oracle"),
    ] {
        if let Some(r) = find(reports, name) {
            outln!(
                "{:>13}  {:>7.1}%  {:>8}  {:>7.0} ms  {:>7.0} ms  {:>8.2}",
                label,
                100.0 * r.hit_rate(),
                vs_oracle(r),
                r.ttft_mean_ms,
                r.ttft_p99_ms,
                r.load_balance()
            );
        }
    }
}

/// Bar charts of hit rate (with the ceiling as a dashed line) and p99 TTFT per policy.
pub fn plot(
    path: &str,
    reports: &[Report],
    ceiling: &Ceiling,
) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    use plotters::style::text_anchor::{HPos, Pos, VPos};

    let root = SVGBackend::new(path, (1500, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 2));
    // Short axis labels: "prefix-affinity (ray)" → "affinity/ray".
    let names: Vec<String> = reports
        .iter()
        .map(|r| match r.policy.strip_prefix("prefix-affinity (") {
            Some(rest) => format!("affinity/{}", rest.trim_end_matches(')')),
            None => r.policy.clone(),
        })
        .collect();
    let ceiling_pct = 100.0 * ceiling.hit_rate();
    /// Title, unit, bar values, bar colour, dashed reference line.
    type Chart<'a> = (&'a str, &'a str, Vec<f64>, RGBColor, Option<f64>);
    let charts: [Chart; 2] = [
        (
            "prefix-cache hit rate (dashed: infinite-cache ceiling)",
            "%",
            reports.iter().map(|r| 100.0 * r.hit_rate()).collect(),
            RGBColor(52, 120, 186),
            Some(ceiling_pct),
        ),
        (
            "p99 time to first token",
            "ms",
            reports.iter().map(|r| r.ttft_p99_ms).collect(),
            RGBColor(214, 96, 77),
            None,
        ),
    ];
    for (area, (title, unit, values, color, line)) in panels.iter().zip(charts) {
        let top = values
            .iter()
            .copied()
            .chain(line)
            .fold(0.0f64, f64::max)
            .max(1e-9)
            * 1.15;
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 20))
            .margin(16)
            .x_label_area_size(60)
            .y_label_area_size(60)
            .build_cartesian_2d((0..names.len()).into_segmented(), 0.0..top)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .y_desc(unit)
            .x_labels(names.len())
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => names.get(*i).map_or(String::new(), |s| s.to_string()),
                _ => String::new(),
            })
            .x_label_style(("sans-serif", 12))
            .draw()?;
        chart.draw_series(
            Histogram::vertical(&chart)
                .style(color.filled())
                .margin(12)
                .data(values.iter().enumerate().map(|(i, &v)| (i, v))),
        )?;
        let label = TextStyle::from(("sans-serif", 13).into_font())
            .pos(Pos::new(HPos::Center, VPos::Bottom));
        chart.draw_series(values.iter().enumerate().map(|(i, &v)| {
            Text::new(
                format!("{v:.1}"),
                (SegmentValue::CenterOf(i), v + top * 0.01),
                label.clone(),
            )
        }))?;
        if let Some(y) = line {
            chart.draw_series(DashedLineSeries::new(
                [(SegmentValue::Exact(0), y), (SegmentValue::Last, y)],
                8,
                5,
                BLACK.stroke_width(2),
            ))?;
        }
    }
    root.present()?;
    Ok(())
}
