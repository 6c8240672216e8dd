//! `--plot FILE.svg` on the quick sweeps the smoke tests run: the real binary writes an SVG, and the SVG (parsed as
//! XML) holds the expected titled axes and one labelled series per figure, each label in its series' colour, with
//! one point per CSV row. No figure is asserted.

use std::process::Command;

fn run(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_ds4-bench")).args(args).output().expect("run ds4-bench");
    assert!(out.status.success(), "ds4-bench {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8 report")
}

/// The CSV rows of a report (header dropped), split into fields.
fn csv_rows(report: &str) -> Vec<Vec<String>> {
    report.lines().filter(|l| !l.starts_with('#')).skip(1).map(|l| l.split(',').map(String::from).collect()).collect()
}

struct Svg {
    /// `(text, fill colour)` of every `<text>`.
    texts: Vec<(String, String)>,
    /// `(stroke colour, number of points)` of every `<polyline>`.
    lines: Vec<(String, usize)>,
    /// Fill colours of every `<rect>`.
    rects: Vec<String>,
}

fn parse(path: &std::path::Path) -> Svg {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let doc = roxmltree::Document::parse(&text).unwrap_or_else(|e| panic!("{} is not XML: {e}", path.display()));
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let mut svg = Svg { texts: Vec::new(), lines: Vec::new(), rects: Vec::new() };
    for n in doc.descendants().filter(|n| n.is_element()) {
        let attr = |a: &str| n.attribute(a).unwrap_or("").to_string();
        match n.tag_name().name() {
            "text" => svg.texts.push((n.text().unwrap_or("").trim().to_string(), attr("fill"))),
            "polyline" => svg.lines.push((attr("stroke"), attr("points").split_whitespace().count())),
            "rect" => svg.rects.push(attr("fill")),
            _ => {}
        }
    }
    svg
}

impl Svg {
    fn text(&self, t: &str) -> &(String, String) {
        self.texts.iter().find(|x| x.0 == t).unwrap_or_else(|| panic!("no text {t:?} in {:?}", self.texts))
    }

    /// The series labelled `label` is a line in the label's colour through `points` points.
    fn assert_series(&self, label: &str, points: usize) {
        let color = &self.text(label).1;
        assert!(
            self.lines.iter().any(|(stroke, n)| stroke == color && *n == points),
            "no {points}-point line in {color} for {label:?}: {:?}",
            self.lines
        );
    }
}

#[test]
fn throughput_plot_has_prefill_decode_and_the_roofline() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("throughput.svg");
    let report = run(&["--synthetic", "tiny:recipe=f16", "--quick", "--quiet", "--plot", path.to_str().unwrap()]);
    assert!(report.contains(&format!("# plot: {}", path.display())), "{report}");
    let rows = csv_rows(&report).len();
    assert_eq!(rows, 2);
    let svg = parse(&path);
    svg.assert_series("prefill t/s", rows);
    svg.assert_series("decode t/s", rows);
    assert_ne!(svg.text("prefill t/s").1, svg.text("decode t/s").1, "series need distinct colours");
    svg.text("context (tokens)");
    svg.text("throughput (tokens/s)");
    assert!(svg.texts.iter().any(|t| t.0.starts_with("decode roofline ") && t.0.ends_with(" t/s")), "{:?}", svg.texts);
}

#[test]
fn kv_plot_has_restore_and_recompute() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("kv.svg");
    let dir = tmp.path().join("store");
    std::fs::create_dir_all(&dir).unwrap();
    let report = run(&["kv", "--quick", "--quiet", "--dir", dir.to_str().unwrap(), "--plot", path.to_str().unwrap()]);
    let rows = csv_rows(&report).len();
    assert_eq!(rows, 3);
    let svg = parse(&path);
    svg.assert_series("recompute (prefill)", rows);
    svg.assert_series("restore from disk", rows);
    svg.text("prefix length (tokens)");
    svg.text("time (ms)");
}

#[test]
fn kernels_plot_has_a_bar_per_decode_kernel_and_the_bandwidth() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("kernels.svg");
    let report = run(&["kernels", "--quick", "--quiet", "--types", "q8_0,iq2_xxs", "--plot", path.to_str().unwrap()]);
    // case,type,...,kernel (column 7): every row but the batched ones (`matmul`, `engine-matmul`) is a named bar.
    let rows: Vec<Vec<String>> = csv_rows(&report).into_iter().filter(|r| !r[7].ends_with("matmul")).collect();
    assert!(rows.len() >= 4, "{report}");
    let svg = parse(&path);
    for r in &rows {
        svg.text(&format!("{} {} · {}", r[0], r[1], r[7]));
    }
    // A value label at each bar's end (GB/s and the share of the measured bandwidth), in the bar's colour.
    let bar_colors: Vec<String> =
        svg.texts.iter().filter(|t| t.0.ends_with(" %)") && t.0.contains(" GB/s (")).map(|t| t.1.clone()).collect();
    assert_eq!(bar_colors.len(), rows.len(), "{:?}", svg.texts);
    let bars = svg.rects.iter().filter(|f| bar_colors.contains(f)).count();
    assert_eq!(bars, rows.len(), "one bar per decode kernel row: {:?}", svg.rects);
    // One bandwidth mark per bar, named once.
    let reference = &svg.text("| = measured read bandwidth").1;
    assert_eq!(svg.lines.iter().filter(|(s, n)| s == reference && *n == 2).count(), rows.len(), "{:?}", svg.lines);
    svg.text("weights streamed (GB/s)");
    assert!(!svg.texts.iter().any(|t| t.0.ends_with("matmul")), "matmul rows are left out");
}

#[test]
fn an_unwritable_plot_path_fails_clearly() {
    let out = Command::new(env!("CARGO_BIN_EXE_ds4-bench"))
        .args(["--synthetic", "tiny:recipe=f16", "--quick", "--quiet", "--plot", "/nonexistent-dir/x.svg"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("ds4-bench: ") && err.contains("plot"), "{err}");
}
