//! The lane layouts' round trips.

use half::f16;

use super::*;

#[test]
fn rows_come_back_in_gguf_layout_byte_for_byte() {
    for ty in [
        BlockType::Q4_0,
        BlockType::Q4_1,
        BlockType::Q5_0,
        BlockType::Q8_0,
    ] {
        // 1, 16, 17 and 35 blocks: a lone group, a full one, tails of 1 and 3.
        // Too few rows for packs, and enough.
        for (blocks, rows) in [1, 16, 17, 35].into_iter().flat_map(|b| [(b, 3), (b, 517)]) {
            let bb = ty.block_bytes();
            let mut data: Vec<u8> = (0..rows * blocks * bb)
                .map(|i| (i * 37 % 253) as u8)
                .collect();
            for (k, blk) in data.chunks_exact_mut(bb).enumerate() {
                let d = f16::from_f32(0.01 * (k + 1) as f32);
                blk[0..2].copy_from_slice(&d.to_le_bytes());
                if ty == BlockType::Q4_1 {
                    blk[2..4].copy_from_slice(&f16::from_f32(-0.5).to_le_bytes());
                }
            }
            for width in [WIDE, NARROW] {
                let lanes = Lanes::pack(ty, rows, blocks * 32, &data, width);
                let mut row = Vec::new();
                for r in 0..rows {
                    lanes.gguf_row(r, &mut row);
                    let want = &data[r * blocks * bb..(r + 1) * blocks * bb];
                    assert_eq!(&row[..], want, "{ty:?}, {blocks} blocks, row {r}, {width}");
                }
            }
        }
    }
}

#[test]
fn k_quant_rows_come_back_byte_for_byte() {
    // 1, 2 and 3 super-blocks: half a group, a full one, one and a half. Every bit
    // of a super-block is used (scales included), so any bytes must come back.
    for ty in [BlockType::Q4K, BlockType::Q6K] {
        // 2500 rows: repacked in three pieces.
        for (supers, rows) in [(1, 5), (2, 5), (3, 5), (3, 2500)] {
            let bb = ty.block_bytes();
            let data: Vec<u8> = (0..rows * supers * bb)
                .map(|i| (i * 131 % 251) as u8)
                .collect();
            for width in [WIDE, NARROW] {
                let lanes = Lanes::pack(ty, rows, supers * 256, &data, width);
                assert!(lanes.k.is_some() && lanes.h.is_empty());
                let mut row = Vec::new();
                for r in 0..rows {
                    lanes.gguf_row(r, &mut row);
                    let want = &data[r * supers * bb..(r + 1) * supers * bb];
                    assert_eq!(
                        &row[..],
                        want,
                        "{ty:?}, {supers} super-blocks, row {r}, {width}"
                    );
                }
            }
        }
    }
}
