//! The CUDA backend's host side on a recording mock device (no GPU): which nodes it takes, that the CPU beside
//! it takes the rest (attention and its host KV included), the launches each of its nodes issues, the residency
//! copies, and clear errors instead of launches for what it cannot run. The kernels' numbers are tested under the
//! host shim (`tests/tests/cuda_backend.rs`).

use std::sync::Arc;

use ds4_kernels_native::cuda_host::{Arg, CudaBufId, CudaMockDevice, Device, DeviceError};
use ds4_kernels_native::cuda_kernels::Plan;
use ds4_kernels_native::BackendKind;
use parking_lot::Mutex;

use super::CudaBackend;
use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::exec::testing::{demo, ticks};
use crate::exec::Executor;
use crate::graph::{BufId, Op};

/// A mock the test keeps a handle on while the backend owns it.
#[derive(Clone, Default)]
struct Shared(Arc<Mutex<CudaMockDevice>>);

impl Device for Shared {
    fn alloc(&mut self, bytes: usize) -> Result<CudaBufId, DeviceError> {
        self.0.lock().alloc(bytes)
    }
    fn upload(&mut self, data: &[u8]) -> Result<CudaBufId, DeviceError> {
        self.0.lock().upload(data)
    }
    fn download(&mut self, buf: CudaBufId) -> Result<Vec<u8>, DeviceError> {
        self.0.lock().download(buf)
    }
    fn write(&mut self, buf: CudaBufId, data: &[u8]) -> Result<(), DeviceError> {
        self.0.lock().write(buf, data)
    }
    fn read(&mut self, buf: CudaBufId, out: &mut [u8]) -> Result<(), DeviceError> {
        self.0.lock().read(buf, out)
    }
    fn free(&mut self, buf: CudaBufId) {
        self.0.lock().free(buf)
    }
    fn size(&self, buf: CudaBufId) -> Option<usize> {
        self.0.lock().size(buf)
    }
    fn launch(&mut self, plan: &Plan, args: &[Arg]) -> Result<(), DeviceError> {
        self.0.lock().launch(plan, args)
    }
}

#[test]
fn takes_products_norms_and_ropes_and_leaves_the_rest_with_the_kv_to_the_cpu() {
    let model = demo();
    let mock = Shared::default();
    let be = CudaBackend::with_device(Box::new(mock.clone()), "mock");
    let cpu = CpuBackend::new(1);
    let mut ex = Executor::default();
    let mut weights = std::collections::BTreeMap::new();
    let mut ticks_seen = 0;
    ticks(&model, &be, Some(&cpu), &mut ex, 5, 2, |g, ex| {
        ticks_seen += 1;
        let rep = ex.placement_report(g);
        assert_eq!((rep.primary, rep.fallback), (BackendKind::Cuda, Some(BackendKind::Cpu)));
        assert_eq!(rep.placed.staged, 0, "no stage runs whole");
        let mut kv_ops_on_cpu = 0;
        for (n, node) in rep.nodes.iter().zip(&g.nodes) {
            let want = match node.op {
                Op::MatMul { w, .. } => {
                    let ok = CudaBackend::product_ok(&model, w);
                    if ok {
                        weights.insert(w.0, model.mat(w).data.len() as u64);
                    }
                    ok
                }
                Op::RmsNorm { w, .. } => {
                    if let Some(w) = w {
                        weights.insert(w.0, 4 * model.dense(w).len() as u64);
                    }
                    true
                }
                Op::Rope { .. } => true,
                Op::HcSinkhorn { layer, sub } => {
                    let lw = &model.layers[layer];
                    let w = if sub == crate::graph::Sub::Attn { lw.hc_attn } else { lw.hc_ffn };
                    for d in [w.base, w.scale] {
                        weights.insert(d.0, 4 * model.dense(d).len() as u64);
                    }
                    true
                }
                Op::HcHeadWeights => {
                    let b = model.global.hc_base;
                    weights.insert(b.0, 4 * model.dense(b).len() as u64);
                    true
                }
                Op::HcCollapse { .. } | Op::HcPost => true,
                Op::Embed => {
                    let e = model.global.embed;
                    weights.insert(e.0, model.mat(e).data.len() as u64);
                    true
                }
                Op::Logits | Op::LogitCandidates { .. } | Op::Readback { .. } => {
                    let ok = super::head::head_ok(&model, None);
                    if ok {
                        let h = model.global.head;
                        weights.insert(h.0, model.mat(h).data.len() as u64);
                    }
                    ok
                }
                Op::CompressPush { .. } | Op::SparseAttention { .. } | Op::WindowStore { .. } => {
                    kv_ops_on_cpu += 1;
                    false
                }
                _ => false,
            };
            assert_eq!(n.backend == BackendKind::Cuda, want, "node {} ({:?}) on {}", n.node, node.op, n.backend);
        }
        assert!(kv_ops_on_cpu > 0 && rep.placed.fallback > 0 && rep.placed.portable > 0);
    })
    .unwrap();
    assert_eq!(ticks_seen, 3);
    // Launches: products quantize their activations (F16 takes f32) and multiply; nothing else but norms, ropes,
    // mHC and the head's row gather was launched (the demo model's experts do not fit the MoE kernels, and these ticks
    // ask for whole logit rows); each weight was uploaded once.
    let dev = mock.0.lock();
    let kinds = |p: &str| dev.launches.iter().filter(|l| l.0.starts_with(p)).count();
    assert!(kinds("ds4_matvec_") > 0 && kinds("ds4_quantize_") > 0 && kinds("ds4_rms_norm") > 0);
    assert!(kinds("ds4_rope") > 0 && kinds("ds4_gather_rows") == 3, "the head's rows gathered once a tick");
    assert!(kinds("ds4_hc_weights") > 0 && kinds("ds4_hc_post") > 0 && kinds("ds4_hc_collapse") > 0);
    assert_eq!(kinds("ds4_embed"), 3, "one embedding launch a tick");
    let known = ["ds4_matvec_", "ds4_quantize_", "ds4_rms_norm", "ds4_rope", "ds4_gather_rows", "ds4_hc_", "ds4_embed"];
    assert_eq!(known.iter().map(|k| kinds(k)).sum::<usize>(), dev.launches.len());
    let c = be.device_counters().unwrap();
    assert_eq!(c.dispatches, dev.launches.len() as u64);
    assert!(c.host_to_device > 0 && c.device_to_host > 0 && c.readbacks > 0);
    assert_eq!(be.device_weight_bytes(), Some(weights.values().sum::<u64>()));
}

/// A node the backend has no kernel for, or a tensor nobody wrote this tick, is an error naming it, not a launch.
#[test]
fn refuses_what_it_cannot_run() {
    let model = demo();
    let mock = Shared::default();
    let be = CudaBackend::with_device(Box::new(mock.clone()), "mock");
    let rope = crate::backend::RopeSet::new(&model);
    let mut batch = crate::graph::Batch::default();
    batch.push_run(0, 0, [1, 2], true);
    let mut act = crate::backend::Activations::default();
    let mut kv = vec![crate::tables::SessionKv::new(&model.config, 8)];
    let mut cx =
        crate::backend::StepCtx { model: &model, rope: &rope, batch: &batch, kv: &mut kv, act: &mut act, sim: false };
    let attn = Op::SparseAttention { layer: 0 };
    assert!(!be.supports(&attn, &model));
    let e = be.run_node(&attn, &mut cx).unwrap_err().to_string();
    assert!(e.contains("no CUDA kernel for"), "{e}");
    let w = model.layers[0].wq_a;
    let op = Op::MatMul { w, x: BufId::Normed, y: BufId::QLow };
    let e = be.run_node(&op, &mut cx).unwrap_err().to_string();
    assert!(e.contains("Normed") && e.contains("not been written"), "{e}");
    let mut out = vec![0.0; 4];
    assert!(be.download(BufId::Q, &mut cx, &mut out).is_err());
    // A held MoE node (see `moe.rs`) followed by anything but its partner, or by the tick's end, is an error.
    be.run_node(&Op::ExpertUp { layer: 0, experts: crate::graph::Experts::PerRow }, &mut cx).unwrap();
    let e = be.run_node(&Op::Embed, &mut cx).unwrap_err().to_string();
    assert!(e.contains("Up(0)") && e.contains("not followed"), "{e}");
    be.begin_tick(&mut cx).unwrap(); // a new tick starts with nothing held
    be.run_node(&Op::ExpertDown { layer: 1, experts: crate::graph::Experts::PerRow }, &mut cx).unwrap();
    let e = be.end_tick(&mut cx).unwrap_err().to_string();
    assert!(e.contains("Down(1)") && e.contains("tick's end"), "{e}");
    assert!(mock.0.lock().launches.is_empty());
}
