//! [`ShimDevice`]: a `cuda_host::Device` over host memory whose launches run the kernels under the host shim.

use ds4_kernels_native::cuda_host::{Arg, CudaBufId, Device, DeviceError};
use ds4_kernels_native::cuda_kernels::{CudaWeight, Plan};

use super::*;

/// Buffers in host memory (8-byte aligned words, freed ones empty) and launches run by the shim, one after
/// another as a stream runs them. Counts launches by kernel.
#[derive(Debug, Default)]
pub struct ShimDevice {
    bufs: Vec<(Vec<u64>, usize)>,
    pub launches: Vec<&'static str>,
}

impl ShimDevice {
    fn buf(&self, b: CudaBufId) -> Result<&(Vec<u64>, usize), DeviceError> {
        match self.bufs.get(b.0 as usize) {
            Some(x) if !x.0.is_empty() => Ok(x),
            _ => Err(DeviceError::Buffer(format!("unknown or freed {b:?}"))),
        }
    }

    /// The launch's arguments as raw pointers and integers, in order.
    fn ptrs(&mut self, args: &[Arg]) -> Result<Vec<Val>, DeviceError> {
        args.iter()
            .map(|a| {
                Ok(match *a {
                    Arg::Buf(b) => {
                        self.buf(b)?;
                        Val::P(self.bufs[b.0 as usize].0.as_mut_ptr().cast())
                    }
                    Arg::Null => Val::P(std::ptr::null_mut()),
                    Arg::I32(v) => Val::I(v),
                    Arg::I64(v) => Val::L(v),
                    Arg::F32(v) => Val::F(v),
                })
            })
            .collect()
    }
}

#[derive(Clone, Copy, Debug)]
enum Val {
    P(*mut u8),
    I(i32),
    L(i64),
    F(f32),
}

impl Val {
    fn p<T>(self) -> *mut T {
        match self {
            Val::P(p) => p.cast(),
            v => panic!("pointer argument expected, got {v:?}"),
        }
    }
    fn i(self) -> i32 {
        match self {
            Val::I(v) => v,
            v => panic!("i32 argument expected, got {v:?}"),
        }
    }
    fn l(self) -> i64 {
        match self {
            Val::L(v) => v,
            v => panic!("i64 argument expected, got {v:?}"),
        }
    }
    fn f(self) -> f32 {
        match self {
            Val::F(v) => v,
            v => panic!("f32 argument expected, got {v:?}"),
        }
    }
}

impl Device for ShimDevice {
    fn alloc(&mut self, bytes: usize) -> Result<CudaBufId, DeviceError> {
        self.bufs.push((vec![0; bytes.div_ceil(8).max(1)], bytes));
        Ok(CudaBufId(self.bufs.len() as u32 - 1))
    }
    fn upload(&mut self, data: &[u8]) -> Result<CudaBufId, DeviceError> {
        let id = self.alloc(data.len())?;
        self.write(id, data)?;
        Ok(id)
    }
    fn download(&mut self, buf: CudaBufId) -> Result<Vec<u8>, DeviceError> {
        let mut out = vec![0; self.buf(buf)?.1];
        self.read(buf, &mut out)?;
        Ok(out)
    }
    fn write(&mut self, buf: CudaBufId, data: &[u8]) -> Result<(), DeviceError> {
        if self.buf(buf)?.1 < data.len() {
            return Err(DeviceError::Buffer(format!("write of {} bytes to {buf:?}", data.len())));
        }
        let words = &mut self.bufs[buf.0 as usize].0;
        bytemuck::cast_slice_mut::<u64, u8>(words)[..data.len()].copy_from_slice(data);
        Ok(())
    }
    fn read(&mut self, buf: CudaBufId, out: &mut [u8]) -> Result<(), DeviceError> {
        let (words, size) = self.buf(buf)?;
        if *size < out.len() {
            return Err(DeviceError::Buffer(format!("read of {} bytes from {buf:?}", out.len())));
        }
        out.copy_from_slice(&bytemuck::cast_slice::<u64, u8>(words)[..out.len()]);
        Ok(())
    }
    fn free(&mut self, buf: CudaBufId) {
        if let Some(b) = self.bufs.get_mut(buf.0 as usize) {
            *b = (Vec::new(), 0);
        }
    }
    fn size(&self, buf: CudaBufId) -> Option<usize> {
        self.buf(buf).ok().map(|b| b.1)
    }
    fn launch(&mut self, plan: &Plan, args: &[Arg]) -> Result<(), DeviceError> {
        let a = self.ptrs(args)?;
        let (g, b) = dims(plan);
        let k = plan.kernel;
        // SAFETY: the host plans (`cuda_host`) pass each kernel's parameters in its order, with every buffer's
        // size checked against the shapes the grid covers; the pointers are this device's live buffers.
        unsafe {
            match k {
                "ds4_quantize_q8_0" => shim_ds4_quantize_q8_0(&g, &b, a[0].p(), a[1].p(), a[2].p(), a[3].i()),
                "ds4_quantize_q8_k" => shim_ds4_quantize_q8_k(&g, &b, a[0].p(), a[1].p(), a[2].p(), a[3].p(), a[4].i()),
                "ds4_rms_norm" => shim_ds4_rms_norm(&g, &b, a[0].p(), a[1].p(), a[2].p(), a[3].i(), a[4].f()),
                "ds4_rope" => shim_ds4_rope(
                    &g,
                    &b,
                    a[0].p(),
                    a[1].p(),
                    a[2].p(),
                    a[3].i(),
                    a[4].i(),
                    a[5].i(),
                    a[6].i(),
                    a[7].i(),
                ),
                "ds4_swiglu" => shim_ds4_swiglu(&g, &b, a[0].p(), a[1].p(), a[2].l(), a[3].f()),
                "ds4_add" => shim_ds4_add(&g, &b, a[0].p(), a[1].p(), a[2].l()),
                "ds4_gather_rows" => shim_ds4_gather_rows(&g, &b, a[0].p(), a[1].p(), a[2].p(), a[3].i(), a[4].i()),
                "ds4_embed" => shim_ds4_embed(
                    &g,
                    &b,
                    a[0].p(),
                    a[1].i(),
                    a[2].l(),
                    a[3].p(),
                    a[4].p(),
                    a[5].i(),
                    a[6].i(),
                    a[7].i(),
                ),
                "ds4_hc_weights" => shim_ds4_hc_weights(
                    &g,
                    &b,
                    a[0].p(),
                    a[1].i(),
                    a[2].p(),
                    a[3].p(),
                    a[4].i(),
                    a[5].f(),
                    a[6].i(),
                    a[7].p(),
                    a[8].p(),
                    a[9].i(),
                ),
                "ds4_hc_head_weights" => shim_ds4_hc_head_weights(
                    &g,
                    &b,
                    a[0].p(),
                    a[1].p(),
                    a[2].f(),
                    a[3].i(),
                    a[4].f(),
                    a[5].p(),
                    a[6].i(),
                ),
                "ds4_hc_collapse" => shim_ds4_hc_collapse(&g, &b, a[0].p(), a[1].p(), a[2].p(), a[3].i(), a[4].i()),
                "ds4_hc_post" => shim_ds4_hc_post(&g, &b, a[0].p(), a[1].p(), a[2].p(), a[3].i(), a[4].i()),
                "ds4_top_candidates" => {
                    shim_ds4_top_candidates(&g, &b, a[0].p(), a[1].i(), a[2].i(), a[3].p(), a[4].p())
                }
                "ds4_moe_route" => shim_ds4_moe_route(
                    &g,
                    &b,
                    a[0].p(),
                    a[1].p(),
                    a[2].p(),
                    a[3].p(),
                    a[4].p(),
                    a[5].p(),
                    a[6].i(),
                    a[7].i(),
                    a[8].i(),
                    a[9].i(),
                    a[10].f(),
                ),
                k if k.starts_with("ds4_moe_gate_up_") => {
                    let (gate_up, _) = moe_fns(moe_type(k)?);
                    gate_up(
                        &g,
                        &b,
                        a[0].p(),
                        a[1].p(),
                        a[2].l(),
                        a[3].i(),
                        a[4].p(),
                        a[5].p(),
                        a[6].p(),
                        a[7].p(),
                        a[8].p(),
                        a[9].p(),
                        a[10].i(),
                        a[11].i(),
                        a[12].i(),
                        a[13].f(),
                    )
                }
                k if k.starts_with("ds4_moe_down_sum_") => {
                    let (_, down_sum) = moe_fns(moe_type(k)?);
                    down_sum(
                        &g,
                        &b,
                        a[0].p(),
                        a[1].l(),
                        a[2].i(),
                        a[3].p(),
                        a[4].p(),
                        a[5].p(),
                        a[6].p(),
                        a[7].p(),
                        a[8].p(),
                        a[9].i(),
                        a[10].i(),
                        a[11].i(),
                    )
                }
                k if k.starts_with("ds4_matvec_f16") => {
                    f16_fn(k)(&g, &b, a[0].p(), a[1].p(), a[2].p(), a[3].i(), a[4].i(), a[5].i())
                }
                k if k.starts_with("ds4_matvec_") => {
                    matvec_fn(k)(&g, &b, a[0].p(), a[1].p(), a[2].p(), a[3].p(), a[4].p(), a[5].i(), a[6].i(), a[7].i())
                }
                k => return Err(DeviceError::Driver(format!("the shim device has no entry for {k}"))),
            }
        }
        self.launches.push(k);
        Ok(())
    }
}

/// The weight type of a MoE kernel's name.
fn moe_type(kernel: &str) -> Result<CudaWeight, DeviceError> {
    [CudaWeight::Iq2Xxs, CudaWeight::Q2K, CudaWeight::Q4K]
        .into_iter()
        .find(|t| kernel.ends_with(t.suffix()))
        .ok_or_else(|| DeviceError::Driver(format!("the shim device has no entry for {kernel}")))
}
