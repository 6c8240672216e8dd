use super::*;

fn naive(w: &[f32], rows: usize, cols: usize, x: &[f32], n: usize) -> Vec<f32> {
    let mut y = vec![0f32; n * rows];
    for b in 0..n {
        for o in 0..rows {
            y[b * rows + o] = (0..cols).map(|k| w[o * cols + k] as f64 * x[b * cols + k] as f64).sum::<f64>() as f32;
        }
    }
    y
}

fn quantized(ty: GgmlType, w: &[f32], rows: usize, cols: usize) -> (Vec<u8>, usize) {
    let rb = ty.row_bytes(cols as u64).unwrap() as usize;
    let mut bytes = vec![0u8; rows * rb];
    for r in 0..rows {
        quant::quantize_row(ty, &w[r * cols..(r + 1) * cols], None, &mut bytes[r * rb..(r + 1) * rb]).unwrap();
    }
    (bytes, rb)
}

fn vals(n: usize, mul: usize, m: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|i| ((i * mul % m) as f32 - m as f32 / 2.0) / scale).collect()
}

/// `m` as given and, where this CPU has the packed Q8_0 kernel, `m` with its rows packed (`pk` holds them):
/// every product must come out the same both ways.
fn both_forms<'a>(m: Mat<'a>, pk: &'a mut Option<quant::PackedMat>) -> Vec<Mat<'a>> {
    if quant::dot_q_packed_kernel(m.ty).is_some() {
        *pk = quant::PackedMat::pack_q8_0(m.data, m.rows, m.row_bytes);
        assert!(pk.is_some(), "a Q8_0 matrix packs");
    }
    let packed = pk.as_ref().map(|p| Mat { packed: Some(p.view()), ..m });
    std::iter::once(m).chain(packed).collect()
}

/// A `rows × cols` matrix of `ty` (bytes, row bytes), `n` input rows and each row's single-row product.
fn row_kernel_case(ty: GgmlType, rows: usize, cols: usize, n: usize) -> (Vec<u8>, usize, Vec<f32>, Vec<f32>) {
    let w = vals(rows * cols, 7919, 1013, 400.0);
    let x = vals(n * cols, 104729, 777, 200.0);
    let (bytes, rb) = quantized(ty, &w, rows, cols);
    let mut want = vec![0f32; n * rows];
    for b in 0..n {
        let (xr, yr) = (&x[b * cols..(b + 1) * cols], &mut want[b * rows..(b + 1) * rows]);
        quant::matvec(ty, &bytes, rows, cols, xr, yr).unwrap();
    }
    (bytes, rb, x, want)
}

#[test]
fn f32_matmul_matches_naive_and_is_batch_invariant() {
    let (rows, cols, n) = (37usize, 70usize, 5usize);
    let w = vals(rows * cols, 7919, 1000, 300.0);
    let x = vals(n * cols, 104729, 777, 200.0);
    let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    let m = Mat { ty: GgmlType::F32, rows, cols, row_bytes: cols * 4, data: &bytes, packed: None };
    let pool = Pool::new(3);
    let mut y = vec![0f32; n * rows];
    matmul(&pool, m, &x, n, &mut y).unwrap();
    let r = naive(&w, rows, cols, &x, n);
    for (a, b) in y.iter().zip(&r) {
        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
    }
    // Row 3 alone gives bit-identical values.
    let mut y1 = vec![0f32; rows];
    matmul(&pool, m, &x[3 * cols..4 * cols], 1, &mut y1).unwrap();
    assert_eq!(&y1[..], &y[3 * rows..4 * rows]);
}

#[test]
fn quantized_matmul_is_close_to_dequantized_f32() {
    let (rows, cols, n) = (8usize, 64usize, 3usize);
    let w = vals(rows * cols, 7919, 1000, 300.0);
    let x = vals(n * cols, 104729, 777, 200.0);
    let (bytes, rb) = quantized(GgmlType::Q8_0, &w, rows, cols);
    let mut deq = vec![0f32; rows * cols];
    for r in 0..rows {
        dequant_row(GgmlType::Q8_0, &bytes[r * rb..(r + 1) * rb], &mut deq[r * cols..(r + 1) * cols]).unwrap();
    }
    let m = Mat { ty: GgmlType::Q8_0, rows, cols, row_bytes: rb, data: &bytes, packed: None };
    let pool = Pool::new(2);
    let mut y = vec![0f32; n * rows];
    matmul(&pool, m, &x, n, &mut y).unwrap();
    let r = naive(&deq, rows, cols, &x, n);
    for (a, b) in y.iter().zip(&r) {
        // Q8_0 activations add ~0.4% relative error per value.
        assert!((a - b).abs() < 0.05 * (1.0 + b.abs()), "{a} vs {b}");
    }
    // Gathered rows give the same values as the full product.
    let mut g = vec![0f32; rows];
    matmul_gather(&pool, m, &x, &[2], &mut g).unwrap();
    assert_eq!(&g[..], &y[2 * rows..3 * rows]);
    // With f32 activations the product is the dequantized weights · x up to f32 rounding (|w|, |x| <= 2, 64
    // terms: 64 · 2^-24 · Σ|w·x| < 1e-3), far tighter than the Q8_0-activation path above.
    let mut pool = Pool::new(2);
    pool.set_f32_acts(true);
    let mut yf = vec![0f32; n * rows];
    matmul(&pool, m, &x, n, &mut yf).unwrap();
    for (a, b) in yf.iter().zip(&r) {
        assert!((a - b).abs() < 1e-3, "f32 activations: {a} vs {b}");
    }
    assert!(yf.iter().zip(&y).any(|(a, b)| a != b), "f32_acts changed nothing");
}

/// Every output is exactly the type's single-row kernel on the quantized activation row, whatever the batch
/// size, pool size, matrix size (inline or pooled, with batch and row blocking) and gather.
#[test]
fn every_output_is_the_row_kernel() {
    for (ty, rows, cols, n) in [
        (GgmlType::Q2K, 300usize, 512usize, 1usize),
        (GgmlType::Q4K, 97, 256, 11),
        (GgmlType::Iq2Xxs, 130, 256, 2),
        // Whole pairs and a lone block, 11 rows: the four-row kernel (where it exists) and the single one.
        (GgmlType::Iq2Xxs, 70, 1536, 11),
        (GgmlType::Iq2Xxs, 33, 1280, 6),
        (GgmlType::Q8_0, 513, 128, 19),
        // Batches of 8 (one flipped-form call per weight row where AVX-512 VNNI is present, else eight- or
        // four-row calls) and an odd block count.
        (GgmlType::Q8_0, 65, 96, 8),
        (GgmlType::Q2K, 64, 512, 9),
        (GgmlType::F16, 70, 64, 9),
        // One long row: activations quantized in block runs across the pool.
        (GgmlType::Q2K, 40, 2048, 1),
        (GgmlType::Q8_0, 30, 4096, 1),
    ] {
        let w = vals(rows * cols, 7919, 1013, 400.0);
        let x = vals(n * cols, 104729, 777, 200.0);
        let (bytes, rb) = quantized(ty, &w, rows, cols);
        let m0 = Mat { ty, rows, cols, row_bytes: rb, data: &bytes, packed: None };
        let mut pk = None;
        let forms = both_forms(m0, &mut pk);
        let mut want = vec![0f32; n * rows];
        for b in 0..n {
            quant::matvec(ty, &bytes, rows, cols, &x[b * cols..(b + 1) * cols], &mut want[b * rows..(b + 1) * rows])
                .unwrap();
        }
        for (threads, m) in [1usize, 2, 3].into_iter().flat_map(|t| forms.iter().map(move |m| (t, *m))) {
            let pool = Pool::new(threads);
            let mut y = vec![f32::NAN; n * rows];
            matmul(&pool, m, &x, n, &mut y).unwrap();
            assert_eq!(y, want, "{ty} {threads} threads, packed {}", m.packed.is_some());
            let idx: Vec<usize> = (0..n).rev().collect();
            let mut g = vec![f32::NAN; n * rows];
            matmul_gather(&pool, m, &x, &idx, &mut g).unwrap();
            for (j, &b) in idx.iter().enumerate() {
                assert_eq!(&g[j * rows..(j + 1) * rows], &want[b * rows..(b + 1) * rows], "{ty} gather");
            }
        }
    }
}

/// Every batch size from 1 to 64 (eight-, four- and one-row kernels in every mix, batch blocking past 8) gives
/// each row exactly its single-row product, for every quantized and float weight type the engine uses.
#[test]
fn every_batch_size_up_to_64_matches_the_row_kernel() {
    for (ty, rows, cols) in [
        (GgmlType::Q8_0, 5usize, 96usize),
        (GgmlType::Q2K, 5, 512),
        (GgmlType::Q4K, 3, 256),
        (GgmlType::Iq2Xxs, 5, 512),
        (GgmlType::F16, 3, 64),
    ] {
        let (bytes, rb, x, want) = row_kernel_case(ty, rows, cols, 64);
        let mut pk = None;
        let pool = Pool::new(2);
        for m in both_forms(Mat { ty, rows, cols, row_bytes: rb, data: &bytes, packed: None }, &mut pk) {
            for n in 1..=64 {
                let mut y = vec![f32::NAN; n * rows];
                matmul(&pool, m, &x, n, &mut y).unwrap();
                assert_eq!(y, want[..n * rows], "{ty}, {n} rows, packed {}", m.packed.is_some());
            }
        }
    }
}

/// Long chunks (prefill: weight rows in L2-sized sub-blocks swept by batch blocks of eight; Q8_0 on the
/// flipped kernel where the CPU has one, Q2_K on its row kernel) give each row exactly its single-row product:
/// batch sizes with every batch-block tail, weight row counts odd and even (the pool's ranges), rows of a
/// whole and a partial last chunk of sixteen blocks, pools of 1–3 threads, gathered rows.
#[test]
fn long_chunks_match_the_row_kernel() {
    for (ty, rows, cols) in [(GgmlType::Q8_0, 301usize, 288usize), (GgmlType::Q8_0, 70, 1024), (GgmlType::Q2K, 9, 512)]
    {
        let nmax = 261;
        let (bytes, rb, x, want) = row_kernel_case(ty, rows, cols, nmax);
        let mut pk = None;
        let forms = both_forms(Mat { ty, rows, cols, row_bytes: rb, data: &bytes, packed: None }, &mut pk);
        for (m, n) in forms.iter().flat_map(|m| [16usize, 17, 18, 19, 20, 21, 33, 64, 99, 256, 261].map(|n| (*m, n))) {
            for threads in [1usize, 2, 3] {
                let pool = Pool::new(threads);
                let mut y = vec![f32::NAN; n * rows];
                matmul(&pool, m, &x, n, &mut y).unwrap();
                assert_eq!(y, want[..n * rows], "{ty}, {n} rows, {threads} threads, packed {}", m.packed.is_some());
            }
            let idx: Vec<usize> = (0..n).map(|j| (j * 37 + 5) % nmax).collect();
            let mut g = vec![f32::NAN; n * rows];
            matmul_gather(&Pool::new(2), m, &x, &idx, &mut g).unwrap();
            for (j, &b) in idx.iter().enumerate() {
                assert_eq!(&g[j * rows..(j + 1) * rows], &want[b * rows..(b + 1) * rows], "{ty} gather, {n} rows");
            }
        }
    }
}

#[test]
fn grouped_products_match_single_products() {
    // Three products of 40 rows each (different matrices and inputs) in one dispatch, written to one buffer.
    let (rows, cols, n) = (40usize, 256usize, 2usize);
    for ty in [GgmlType::Q4K, GgmlType::Q8_0] {
        let w = vals(3 * rows * cols, 7919, 1013, 400.0);
        let (bytes, rb) = quantized(ty, &w, 3 * rows, cols);
        let all = Mat { ty, rows: 3 * rows, cols, row_bytes: rb, data: &bytes, packed: None };
        let x = vals(4 * cols, 104729, 777, 200.0);
        let k = Kernel::for_type(ty, cols).unwrap();
        let mut acts = Acts::new();
        acts.prepare(&k, &x, RowAt::Strided { stride: cols, off: 0 }, 4, cols).unwrap();
        let idx = [[3usize, 0], [1, 2], [2, 2]];
        let pool = Pool::new(2);
        let mut pk = None;
        // Row runs of a packed matrix (`Mat::rows_slice`) too, against the products on the blocks as stored.
        for m in both_forms(all, &mut pk) {
            let mut y = vec![f32::NAN; 3 * n * rows];
            let out = Out::new(&mut y, rows, 0);
            let product = |u: usize| Product {
                w: m.rows_slice(u * rows, rows),
                k,
                input: acts.input(&k, &x, cols, RowAt::Gather { idx: &idx[u], stride: 1 }),
                n,
                out: out.shifted(u * n * rows),
            };
            // SAFETY: product `u` writes only y[u*n*rows..(u+1)*n*rows]; `y` outlives the call.
            unsafe { run_group(&pool, 3, rows, 7, &product) };
            for u in 0..3 {
                let mut want = vec![0f32; n * rows];
                matmul_gather(&pool, all.rows_slice(u * rows, rows), &x, &idx[u], &mut want).unwrap();
                let what = format!("product {u}, packed {}", m.packed.is_some());
                assert_eq!(&y[u * n * rows..(u + 1) * n * rows], &want[..], "{what}");
            }
        }
    }
}

/// Several products in one dispatch (shared and distinct inputs, mixed weight types and activation formats,
/// inline and pooled sizes) give bit-identical outputs to running them one by one.
#[test]
fn many_products_match_single_products() {
    let cols = 512usize;
    let shapes = [(GgmlType::Q8_0, 300usize), (GgmlType::Q2K, 77), (GgmlType::F16, 5), (GgmlType::Q4K, 130)];
    let mats: Vec<(Vec<u8>, usize)> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(ty, rows))| quantized(ty, &vals(rows * cols, 7919 + i, 1013, 400.0), rows, cols))
        .collect();
    let mat = |i: usize| Mat {
        ty: shapes[i].0,
        rows: shapes[i].1,
        cols,
        row_bytes: mats[i].1,
        data: &mats[i].0,
        packed: None,
    };
    for n in [1usize, 3, 9] {
        let xa = vals(n * cols, 104729, 777, 200.0);
        let xb = vals(n * cols, 7717, 555, 150.0);
        // Products 0, 1 and 3 read `xa` (in two activation formats: Q8_0 and Q8_K), 2 reads `xb`.
        let inputs: [&[f32]; 4] = [&xa, &xa, &xb, &xa];
        for threads in [1usize, 2, 3] {
            let pool = Pool::new(threads);
            let want: Vec<Vec<f32>> = (0..4)
                .map(|i| {
                    let mut y = vec![f32::NAN; n * shapes[i].1];
                    matmul(&pool, mat(i), inputs[i], n, &mut y).unwrap();
                    y
                })
                .collect();
            let mut ys: Vec<Vec<f32>> = (0..4).map(|i| vec![f32::NAN; n * shapes[i].1]).collect();
            let mut it = ys.iter_mut();
            let mut jobs: Vec<Option<MatJob<'_>>> =
                (0..4).map(|i| Some(MatJob { w: mat(i), x: inputs[i], y: it.next().unwrap() })).collect();
            matmul_many(&pool, &mut jobs, n).unwrap();
            drop(jobs);
            assert_eq!(ys, want, "{n} rows, {threads} threads");
            // A small group (run inline) too.
            let mut y2 = vec![f32::NAN; n * 5];
            let mut jobs = [Some(MatJob { w: mat(2), x: &xb, y: &mut y2 })];
            matmul_many(&pool, &mut jobs, n).unwrap();
            assert_eq!(y2, want[2]);
        }
    }
}

#[test]
fn parallel_activation_quantization_is_byte_identical() {
    for (ty, cols) in [(GgmlType::Q2K, 2048usize), (GgmlType::Q8_0, 4096), (GgmlType::Q4K, 256)] {
        let k = Kernel::for_type(ty, cols).unwrap();
        for n in [1usize, 2, 5] {
            let x = vals(n * cols + 7, 104729, 777, 200.0);
            let at = RowAt::Strided { stride: cols, off: 7 };
            let mut serial = Acts::new();
            serial.prepare(&k, &x, at, n, cols).unwrap();
            for threads in [2usize, 3] {
                let mut par = Acts::new();
                par.prepare_par(&Pool::new(threads), &k, &x, at, n, cols).unwrap();
                assert_eq!(par.bytes()[..n * par.row_bytes()], serial.bytes()[..n * serial.row_bytes()]);
            }
            // A bad value gives the whole-row error (index within the row).
            let mut bad = x.clone();
            bad[7 + (n - 1) * cols + cols - 3] = f32::INFINITY;
            let e1 = serial.prepare(&k, &bad, at, n, cols).unwrap_err().to_string();
            let e2 = Acts::new().prepare_par(&Pool::new(3), &k, &bad, at, n, cols).unwrap_err().to_string();
            assert_eq!(e1, e2);
            assert!(e1.contains(&format!("x[{}]", cols - 3)), "{e1}");
        }
    }
}

#[test]
fn bad_activations_are_an_error() {
    let (rows, cols) = (4usize, 256usize);
    let w = vals(rows * cols, 7919, 1013, 400.0);
    let (bytes, rb) = quantized(GgmlType::Q2K, &w, rows, cols);
    let m = Mat { ty: GgmlType::Q2K, rows, cols, row_bytes: rb, data: &bytes, packed: None };
    let mut x = vals(cols, 104729, 777, 200.0);
    x[5] = f32::NAN;
    let mut y = vec![0f32; rows];
    assert!(matmul(&Pool::new(2), m, &x, 1, &mut y).is_err());
}
