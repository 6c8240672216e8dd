//! A host-memory [`DeviceMem`] for tests: buffers are word vectors, an encoder is a list of commands run in order
//! at submit (as a device queue runs them, so a write recorded after a read cannot overtake it), and a copy within
//! one buffer or out of a buffer's range fails the submit, as a device validation error would.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use super::{dev_err, DeviceMem};
use crate::Result;

/// A mock device buffer (shared handle; compared by identity).
#[derive(Clone, Debug)]
pub struct MockBuf(Rc<RefCell<Vec<u32>>>);

/// A temporary buffer of the mock.
#[derive(Debug)]
pub struct MockTemp(MockBuf);

impl std::ops::Deref for MockTemp {
    type Target = MockBuf;
    fn deref(&self) -> &MockBuf {
        &self.0
    }
}

/// A recorded command.
#[derive(Debug)]
pub enum Cmd {
    Copy { src: MockBuf, src_at: u64, dst: MockBuf, dst_at: u64, bytes: u64 },
    Clear { b: MockBuf, at: u64, bytes: u64 },
    AddApe { g: MockBuf, off: usize, rows: usize, w: usize, ape: MockBuf, pos0: usize, ratio: usize },
}

/// The mock device (see the module docs).
#[derive(Debug)]
pub struct MockDevice {
    max_binding: u64,
    /// Encoders handed out and not yet submitted.
    open: Cell<isize>,
    /// Bytes copied between buffers by submitted commands.
    copied: Cell<u64>,
}

impl MockDevice {
    /// A mock whose binding limit is `max_binding` bytes (default 1 GiB).
    pub fn new(max_binding: Option<u64>) -> MockDevice {
        MockDevice { max_binding: max_binding.unwrap_or(1 << 30), open: Cell::new(0), copied: Cell::new(0) }
    }

    /// Encoders handed out and not submitted yet.
    pub fn pending(&self) -> isize {
        self.open.get()
    }

    /// Bytes copied between buffers by the commands submitted so far.
    pub fn copied_bytes(&self) -> u64 {
        self.copied.get()
    }

    /// The words of `b` as f32 (the buffer's current contents: call after submitting).
    pub fn contents(b: &MockBuf) -> Vec<f32> {
        b.0.borrow().iter().map(|&w| f32::from_bits(w)).collect()
    }

    fn run(&self, enc: Vec<Cmd>) -> Result<()> {
        self.open.set(self.open.get() - 1);
        let range = |len: usize, at: u64, bytes: u64, what: &str| -> Result<std::ops::Range<usize>> {
            if !at.is_multiple_of(4) || !bytes.is_multiple_of(4) || at + bytes > (len * 4) as u64 {
                return Err(dev_err(format!("mock: {what} of {bytes} bytes at {at} out of a {len}-word buffer")));
            }
            Ok((at / 4) as usize..((at + bytes) / 4) as usize)
        };
        for c in enc {
            match c {
                Cmd::Copy { src, src_at, dst, dst_at, bytes } => {
                    if Rc::ptr_eq(&src.0, &dst.0) {
                        return Err(dev_err("mock: a copy within one buffer"));
                    }
                    let (s, mut d) = (src.0.borrow(), dst.0.borrow_mut());
                    let (rs, rd) =
                        (range(s.len(), src_at, bytes, "copy source")?, range(d.len(), dst_at, bytes, "copy")?);
                    d[rd].copy_from_slice(&s[rs]);
                    self.copied.set(self.copied.get() + bytes);
                }
                Cmd::Clear { b, at, bytes } => {
                    let mut v = b.0.borrow_mut();
                    let r = range(v.len(), at, bytes, "clear")?;
                    v[r].fill(0);
                }
                Cmd::AddApe { g, off, rows, w, ape, pos0, ratio } => {
                    let (mut gv, av) = (g.0.borrow_mut(), ape.0.borrow());
                    if off + rows * w > gv.len() || ratio == 0 || ratio * w > av.len() {
                        return Err(dev_err("mock: add_ape out of range"));
                    }
                    for r in 0..rows {
                        let a = (pos0 + r) % ratio;
                        for c in 0..w {
                            let x = f32::from_bits(gv[off + r * w + c]) + f32::from_bits(av[a * w + c]);
                            gv[off + r * w + c] = x.to_bits();
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

impl DeviceMem for MockDevice {
    type Buf = MockBuf;
    type Temp = MockTemp;
    type Enc = Vec<Cmd>;

    fn max_binding(&self) -> u64 {
        self.max_binding
    }

    fn zeroed(&self, _label: &'static str, words: usize) -> MockBuf {
        MockBuf(Rc::new(RefCell::new(vec![0; words])))
    }

    fn upload_f32(&self, _label: &'static str, data: &[f32]) -> MockBuf {
        MockBuf(Rc::new(RefCell::new(data.iter().map(|x| x.to_bits()).collect())))
    }

    fn upload_u32(&self, _label: &'static str, data: &[u32]) -> MockBuf {
        MockBuf(Rc::new(RefCell::new(data.to_vec())))
    }

    fn temp(&self, words: usize) -> MockTemp {
        // Contents undefined: filled with a NaN pattern so a read of an unwritten word shows.
        MockTemp(MockBuf(Rc::new(RefCell::new(vec![f32::NAN.to_bits(); words.max(1)]))))
    }

    fn size(&self, b: &MockBuf) -> u64 {
        (b.0.borrow().len() * 4) as u64
    }

    fn encoder(&self) -> Vec<Cmd> {
        self.open.set(self.open.get() + 1);
        Vec::new()
    }

    fn copy(&self, enc: &mut Vec<Cmd>, src: &MockBuf, src_at: u64, dst: &MockBuf, dst_at: u64, bytes: u64) {
        enc.push(Cmd::Copy { src: src.clone(), src_at, dst: dst.clone(), dst_at, bytes });
    }

    fn clear(&self, enc: &mut Vec<Cmd>, b: &MockBuf, at: u64, bytes: u64) {
        enc.push(Cmd::Clear { b: b.clone(), at, bytes });
    }

    fn add_ape(
        &self,
        enc: &mut Vec<Cmd>,
        g: &MockBuf,
        off: usize,
        rows: usize,
        w: usize,
        ape: &MockBuf,
        pos0: usize,
        ratio: usize,
    ) -> Result<()> {
        enc.push(Cmd::AddApe { g: g.clone(), off, rows, w, ape: ape.clone(), pos0, ratio });
        Ok(())
    }

    fn submit(&self, enc: Vec<Cmd>) -> Result<()> {
        self.run(enc)
    }

    fn submit_read_f32(&self, enc: Vec<Cmd>, b: &MockBuf, offset: usize, len: usize) -> Result<Vec<f32>> {
        self.run(enc)?;
        let v = b.0.borrow();
        let words = v.get(offset..offset + len).ok_or_else(|| dev_err("mock: read out of range"))?;
        Ok(words.iter().map(|&w| f32::from_bits(w)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Commands run at submit, in order; a copy within one buffer or out of range fails the submit.
    #[test]
    fn commands_run_in_order_at_submit() {
        let dev = MockDevice::new(None);
        let a = dev.upload_f32("a", &[1.0, 2.0, 3.0, 4.0]);
        let b = dev.zeroed("b", 4);
        let mut enc = dev.encoder();
        dev.copy(&mut enc, &a, 4, &b, 0, 8);
        dev.clear(&mut enc, &a, 0, 16);
        dev.copy(&mut enc, &a, 0, &b, 8, 4);
        assert_eq!(MockDevice::contents(&b), vec![0.0; 4], "nothing runs before the submit");
        assert_eq!(dev.pending(), 1);
        dev.submit(enc).unwrap();
        assert_eq!(MockDevice::contents(&b), vec![2.0, 3.0, 0.0, 0.0]);
        assert_eq!((dev.pending(), dev.copied_bytes()), (0, 12));
        let mut enc = dev.encoder();
        dev.copy(&mut enc, &a, 0, &a, 8, 4);
        assert!(dev.submit(enc).is_err(), "a copy within one buffer");
        let mut enc = dev.encoder();
        dev.copy(&mut enc, &a, 12, &b, 0, 8);
        assert!(dev.submit(enc).is_err(), "out of range");
        let ape = dev.upload_f32("ape", &[10.0, 20.0]);
        let mut enc = dev.encoder();
        dev.add_ape(&mut enc, &b, 1, 2, 1, &ape, 1, 2).unwrap();
        assert_eq!(dev.submit_read_f32(enc, &b, 0, 4).unwrap(), vec![2.0, 23.0, 10.0, 0.0]);
    }
}
