use super::*;

fn chain() -> Graph {
    let mut g = Graph::default();
    g.clear(1);
    g.stage(Stage::Embed);
    g.push(Op::Embed); // 0
    g.stage(Stage::HcHead);
    let w = WeightId(0);
    g.push(Op::RmsNorm { x: BufId::Streams, y: BufId::StreamsNormed, w: None, width: 4, heads: 1 }); // 1
    g.push(Op::MatMul { w, x: BufId::StreamsNormed, y: BufId::Q }); // 2
    g.push(Op::MatMul { w, x: BufId::StreamsNormed, y: BufId::KvRows }); // 3
    g.push(Op::Rope { x: BufId::Q, layer: 0, width: 4, heads: 1, inverse: false }); // 4
    g.push(Op::RmsNorm { x: BufId::Streams, y: BufId::StreamsNormed, w: None, width: 4, heads: 1 }); // 5: WAR on 2, 3
    g.finish();
    g
}

#[test]
fn dependencies_follow_declared_reads_and_writes() {
    let g = chain();
    assert_eq!(g.deps, vec![0, 1, 1, 1, 1, 4], "5: RAW on 0, WAW on 1, WAR on 2 and 3");
    assert_eq!(g.dependents(0), &[1, 5]);
    assert_eq!(g.dependents(1), &[2, 3, 5]);
    assert_eq!(g.dependents(2), &[4, 5]);
    assert_eq!(g.dependents(3), &[5]);
    assert!(g.edges.iter().all(|&(a, b)| a < b), "edges go forward");
    assert_eq!(g.stages, vec![(Stage::Embed, 0, 1), (Stage::HcHead, 1, 6)]);
    let dot = g.to_dot(&|w| format!("w{}", w.0));
    assert!(dot.starts_with("digraph") && dot.contains("n1 -> n2;") && dot.contains("cluster_1"));
    assert!(dot.contains("2: MatMul { w: w0, x: StreamsNormed, y: Q }"), "{dot}");
}

#[test]
fn rebuilding_reuses_capacity() {
    let mut g = chain();
    let caps = (g.nodes.capacity(), g.edges.capacity());
    g.clear(1);
    g.stage(Stage::Embed);
    g.push(Op::Embed);
    g.finish();
    assert_eq!(g.deps, vec![0]);
    assert_eq!((g.nodes.capacity(), g.edges.capacity()), caps);
}

#[test]
fn op_kinds_index_the_kind_names() {
    assert_eq!(Op::KINDS.len(), OpKind::ALL.len() + 1);
    assert_eq!(Op::KINDS[Op::STAGE_KIND], "stage");
    let op = Op::WindowStore { layer: 3 };
    assert_eq!(op.op_kind(), OpKind::WindowStore);
    assert_eq!(op.name(), "window_store");
    assert_eq!(Op::KINDS[Op::HcPost.kind()], "hc_post");
}

#[test]
fn batch_rows_and_logit_rows() {
    let mut b = Batch::default();
    b.push_run(3, 10, [7, 8, 9], false);
    b.push_run(1, 0, [5, 6], true);
    assert_eq!(b.rows.len(), 5);
    assert_eq!(b.rows[2], Row { run: 0, pos: 12, token: 9 });
    assert_eq!(b.runs[1], Run { slot: 1, start: 3, len: 2, all_logits: true });
    assert_eq!(b.logit_rows, vec![2, 3, 4]);
    assert!(!b.is_decode());
}
