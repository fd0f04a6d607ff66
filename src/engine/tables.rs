//! The decode batch's block tables on the device, kept from step to step: a step uploads only
//! the entries that differ from what each device row already holds.
//!
//! Before, every step uploaded every row padded to the model's length (131,072 positions:
//! 32 KB a sequence, 1.08 GB over PCIe for a 7B rollout of 8 sequences × 4,096 tokens). A
//! decoding sequence's row changes only when it gets a new block (every `block_size` tokens)
//! or when another sequence takes its row, so most steps now upload nothing for the tables.
//!
//! Owns: [`BlockTables`] (a host mirror of each device row's valid prefix). May call:
//! `crate::device` (host-to-device writes). Must not: read the device table back, or make
//! entries past a row's blocks meaningful: those are stale (the attention kernels, CUDA and
//! CPU, read `table[key / block_size]` for keys below the row's context length only).

use crate::device::Tensor;
use anyhow::{bail, Result};

pub(crate) struct BlockTables {
    maxb: usize,
    held: Vec<u32>,       // (rows, maxb): what each device row holds
    held_len: Vec<usize>, // (rows): how much of it is valid
}

impl BlockTables {
    /// The mirror of a device table of `rows` × `maxb` entries that holds nothing valid yet.
    pub fn new(rows: usize, maxb: usize) -> BlockTables {
        BlockTables { maxb, held: vec![0; rows * maxb], held_len: vec![0; rows] }
    }

    /// Assumes nothing about the device rows: the next upload writes every row whole.
    pub fn forget(&mut self) {
        self.held_len.fill(0);
    }

    /// Makes device row r start with `blocks[offs[r]..offs[r + 1]]`, for every r the offsets
    /// name, by one host-to-device write per row that differs (from its first differing
    /// entry on). Returns the entries written.
    pub fn upload(&mut self, table: &mut Tensor, blocks: &[u32], offs: &[u32]) -> Result<usize> {
        let rows = offs.len().saturating_sub(1);
        if rows > self.held_len.len() {
            bail!("engine: {rows} block-table rows for a table of {}", self.held_len.len());
        }
        let mut written = 0;
        for r in 0..rows {
            let row = &blocks[offs[r] as usize..offs[r + 1] as usize];
            if row.len() > self.maxb {
                bail!("engine: a sequence needs {} blocks, tables hold {}", row.len(), self.maxb);
            }
            let held = &mut self.held[r * self.maxb..(r + 1) * self.maxb];
            let same = held[..self.held_len[r].min(row.len())].iter().zip(row).take_while(|(a, b)| a == b).count();
            if same < row.len() {
                table.write_u32_at(r * self.maxb + same, &row[same..])?;
                held[same..row.len()].copy_from_slice(&row[same..]);
                written += row.len() - same;
            }
            // The entries past the row are still what the device holds.
            self.held_len[r] = self.held_len[r].max(row.len());
        }
        Ok(written)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{DType, Device};

    /// The device rows' prefixes after each upload equal the staged rows, and the entries
    /// written are the hand-counted differences; on the CPU and on the simulated GPU (whose
    /// writes land at an offset into the table's allocation).
    #[test]
    fn a_step_uploads_only_the_entries_that_changed_sim() {
        uploads_only_what_changed(&Device::cpu(1).unwrap());
        uploads_only_what_changed(&Device::parse("cuda-sim:0").unwrap());
    }

    fn uploads_only_what_changed(dev: &Device) {
        let mut t = dev.zeros(DType::U32, &[3, 4]).unwrap();
        let mut m = BlockTables::new(3, 4);
        let check = |t: &Tensor, blocks: &[u32], offs: &[u32]| {
            let held = t.to_u32_vec().unwrap();
            for r in 0..offs.len() - 1 {
                let row = &blocks[offs[r] as usize..offs[r + 1] as usize];
                assert_eq!(&held[r * 4..r * 4 + row.len()], row, "row {r}");
            }
        };
        // Two sequences start: all 3 entries are new.
        let steps: [(&[u32], &[u32], usize); 6] = [
            (&[7, 8, 9], &[0, 2, 3], 3),
            // Nothing changed.
            (&[7, 8, 9], &[0, 2, 3], 0),
            // The second sequence gets a block: one entry.
            (&[7, 8, 9, 4], &[0, 2, 4], 1),
            // The first finishes; the second moves to row 0 (3 entries differ from row 0's
            // [7, 8]), and a third sequence takes row 1 (its [5] differs at entry 0).
            (&[9, 4, 1, 5], &[0, 3, 4], 4),
            // Row 1 holds no sequence this step: nothing to write.
            (&[9, 4, 1], &[0, 3, 3], 0),
            // ... and grows again: it still holds [5, 4], so only the 6 is written.
            (&[9, 4, 1, 5, 6], &[0, 3, 5], 1),
        ];
        for (i, (blocks, offs, n)) in steps.into_iter().enumerate() {
            assert_eq!(m.upload(&mut t, blocks, offs).unwrap(), n, "step {i}");
            check(&t, blocks, offs);
        }
        // After `forget`, every row is written whole.
        m.forget();
        assert_eq!(m.upload(&mut t, &[9, 4, 1, 5, 6], &[0, 3, 5]).unwrap(), 5);
        check(&t, &[9, 4, 1, 5, 6], &[0, 3, 5]);
        // A row longer than the table, or more rows than it has, are errors.
        assert!(m.upload(&mut t, &[1, 2, 3, 4, 5], &[0, 5]).is_err());
        assert!(m.upload(&mut t, &[1, 2, 3, 4], &[0, 1, 2, 3, 4]).is_err());
    }
}
