// IQ2_XXS: 66-byte blocks of 256 values: f16 d, then 8 groups of 32 values, each two u32 words (a0, a1):
// a0 holds four 8-bit indices into the 256-entry grid (8 magnitudes each), a1 holds four 7-bit sign indices
// (bits 0..27) and a 4-bit scale (bits 28..31). Group scale db = d * (0.5 + scale) / 4. A 7-bit sign index s
// expands to 8 sign bits s | parity(s) << 7. Value = db * grid[j] * (sign bit j ? -1 : 1).
const BLOCK_VALUES: u32 = 256u;
const BLOCK_BYTES: u32 = 66u;
// Invocations that share one weight row in a product (lanes.wgsl): fewer for bigger blocks, so a row's
// blocks keep every lane busy.
const ROW_LANES: u32 = 8u;

// The iq2xxs grid (a format constant): entry e is the 16-bit half (e & 1) of word e / 2; magnitude j is the
// 2-bit code (half >> 2j) & 3 mapped 0 -> 8, 1 -> 25, 2 -> 43.
const IQ2XXS_GRID = array<u32, 128>(
    0x00020000u, 0x00080005u, 0x0011000au, 0x00200014u, 0x00280022u, 0x0041002au, 0x00500044u, 0x00610058u,
    0x00800064u, 0x008a0082u, 0x010100a2u, 0x01100104u, 0x01400115u, 0x01980184u, 0x02020200u, 0x02820222u,
    0x04040401u, 0x04210410u, 0x04400424u, 0x04480442u, 0x04810460u, 0x04900484u, 0x050004a4u, 0x05080502u,
    0x05460520u, 0x05800569u, 0x06090591u, 0x06400610u, 0x06a40684u, 0x08050800u, 0x08140808u, 0x08410828u,
    0x08500844u, 0x08880852u, 0x09400904u, 0x0a140a02u, 0x10041001u, 0x10211010u, 0x10601040u, 0x10901084u,
    0x11001095u, 0x11201108u, 0x115a1150u, 0x12241180u, 0x14001245u, 0x14201408u, 0x14491425u, 0x15181480u,
    0x16001562u, 0x18011616u, 0x18101804u, 0x18811840u, 0x19051900u, 0x1a5119a0u, 0x20022000u, 0x2044200au,
    0x20802061u, 0x21292082u, 0x22002148u, 0x24012202u, 0x24102404u, 0x24562440u, 0x25412500u, 0x26902564u,
    0x28202808u, 0x2a442894u, 0x40044001u, 0x40184010u, 0x40244021u, 0x40484040u, 0x40604056u, 0x40844081u,
    0x41004090u, 0x41614120u, 0x41854180u, 0x42104201u, 0x42564248u, 0x44004268u, 0x44204408u, 0x44994480u,
    0x45244512u, 0x48014600u, 0x48104804u, 0x48454840u, 0x49584900u, 0x49824961u, 0x4a904a45u, 0x50085000u,
    0x50195011u, 0x50805020u, 0x51045088u, 0x51a45142u, 0x54905291u, 0x550a5492u, 0x56545601u, 0x58115800u,
    0x58645819u, 0x5a085940u, 0x60106004u, 0x60686040u, 0x61556100u, 0x62606218u, 0x64056400u, 0x65126510u,
    0x68426584u, 0x80028000u, 0x8041800au, 0x81048082u, 0x81408118u, 0x84018211u, 0x84108404u, 0x84408415u,
    0x85008460u, 0x85948546u, 0x86408609u, 0x88028660u, 0x8a118904u, 0x90109004u, 0x90409024u, 0x911690a1u,
    0x92459180u, 0x94229400u, 0x95519444u, 0x99209881u, 0xa050a002u, 0xa109a085u, 0xa418a200u, 0xa904a850u,
);

// The grid staged in workgroup memory by quant_setup for block_dot (the products' hot loop): a `const` array
// indexed at run time is copied into every invocation's private memory by some shader compilers (naga's SPIR-V
// output, wgpu#6390), once per use. Kernels of 64 invocations call quant_setup(li) first, all of them.
var<workgroup> iq2_grid: array<u32, 128>;

fn quant_setup(li: u32) {
    iq2_grid[li] = IQ2XXS_GRID[li];
    iq2_grid[li + 64u] = IQ2XXS_GRID[li + 64u];
    workgroupBarrier();
}

fn iq2_mag(code: u32) -> f32 {
    return f32(8u + 17u * code + (code >> 1u));
}

fn iq2_signs(s7: u32) -> u32 {
    return s7 | ((countOneBits(s7) & 1u) << 7u);
}

fn block_value(rb: u32, blk: u32, nb: u32, i: u32) -> f32 {
    let b = rb + blk * BLOCK_BYTES;
    let g = i / 32u;
    let l = (i % 32u) / 8u;
    let j = i % 8u;
    let a0 = ld_u32(b + 2u + 8u * g);
    let a1 = ld_u32(b + 6u + 8u * g);
    let db = ld_f16(b) * (0.5 + f32(a1 >> 28u)) * 0.25;
    let gi = (a0 >> (8u * l)) & 0xffu;
    let half = IQ2XXS_GRID[gi >> 1u] >> (16u * (gi & 1u));
    let signs = iq2_signs((a1 >> (7u * l)) & 127u);
    let sgn = select(1.0, -1.0, ((signs >> j) & 1u) != 0u);
    return db * iq2_mag((half >> (2u * j)) & 3u) * sgn;
}

fn block_dot(rb: u32, blk: u32, nb: u32, x0: u32) -> f32 {
    let b = rb + blk * BLOCK_BYTES;
    let d = ld_f16(b);
    var s = 0.0;
    for (var g = 0u; g < 8u; g++) {
        let a0 = ld_u32(b + 2u + 8u * g);
        let a1 = ld_u32(b + 6u + 8u * g);
        var sg = 0.0;
        for (var l = 0u; l < 4u; l++) {
            let gi = (a0 >> (8u * l)) & 0xffu;
            let half = iq2_grid[gi >> 1u] >> (16u * (gi & 1u));
            let signs = iq2_signs((a1 >> (7u * l)) & 127u);
            let xb = x0 + 32u * g + 8u * l;
            for (var j = 0u; j < 8u; j++) {
                let m = iq2_mag((half >> (2u * j)) & 3u);
                sg += select(m, -m, ((signs >> j) & 1u) != 0u) * x[xb + j];
            }
        }
        s += d * (0.5 + f32(a1 >> 28u)) * 0.25 * sg;
    }
    return s;
}
