//! Turning the requests chosen for a step into the flat arrays of a plan.

use crate::block_allocator::NULL_BLOCK;
use crate::plan::BatchPlan;
use crate::scheduler::{Chosen, Scheduler};

impl Scheduler {
    pub(crate) fn build_plan(
        &self,
        step_id: u64,
        mut chosen: Vec<Chosen>,
        preempted_ids: Vec<u64>,
        aborted_ids: Vec<u64>,
    ) -> BatchPlan {
        // Decodes first, otherwise in the order chosen.
        chosen.sort_by_key(|c| c.num_tokens != 1);
        let bs = self.config.block_size;
        let num_reqs = chosen.len();
        let num_tokens: usize = chosen.iter().map(|c| c.num_tokens).sum();
        let width = chosen
            .iter()
            .map(|c| self.req(c.slot).block_table.len())
            .max()
            .unwrap_or(0);
        let mut plan = BatchPlan {
            step_id,
            req_ids: Vec::with_capacity(num_reqs),
            num_scheduled_tokens: Vec::with_capacity(num_reqs),
            num_computed_tokens: Vec::with_capacity(num_reqs),
            num_decodes: chosen.iter().take_while(|c| c.num_tokens == 1).count(),
            num_draft_tokens: Vec::with_capacity(num_reqs),
            num_drafts_total: chosen.iter().map(|c| c.num_draft).sum(),
            input_ids: Vec::with_capacity(num_tokens),
            positions: Vec::with_capacity(num_tokens),
            query_start_loc: Vec::with_capacity(num_reqs + 1),
            seq_lens: Vec::with_capacity(num_reqs),
            adapters: Vec::with_capacity(num_reqs),
            block_table: Vec::with_capacity(num_reqs * width),
            block_table_width: width,
            slot_mapping: Vec::with_capacity(num_tokens),
            window_block_table: Vec::new(),
            window_slot_mapping: Vec::new(),
            state_slots: Vec::new(),
            state_restores: Vec::new(),
            state_saves: Vec::new(),
            kv_copy_src: Vec::new(),
            kv_copy_dst: Vec::new(),
            logits_indices: Vec::with_capacity(num_reqs),
            sample_rows: Vec::with_capacity(num_reqs),
            preempted_ids,
            aborted_ids,
            slots: Vec::with_capacity(num_reqs),
            draft_tokens: Vec::new(),
        };
        let windowed = self.window_alloc.is_some();
        if windowed {
            plan.window_block_table.reserve(num_reqs * width);
            plan.window_slot_mapping.reserve(num_tokens);
        }
        let stateful = self.config.num_state_slots > 0;
        if stateful {
            plan.state_slots.reserve(num_reqs);
        }
        plan.query_start_loc.push(0);
        for (row, c) in chosen.iter().enumerate() {
            let req = self.req(c.slot);
            let start = req.num_computed_tokens;
            let end = start + c.num_tokens;
            // A row with drafts: its pending token, then the drafts.
            let known_end = end - c.num_draft;
            plan.req_ids.push(req.id);
            plan.slots.push(c.slot);
            plan.num_scheduled_tokens.push(c.num_tokens as i32);
            plan.num_computed_tokens.push(start as i32);
            plan.num_draft_tokens.push(c.num_draft as i32);
            plan.seq_lens.push(end as i32);
            plan.adapters.push(req.params.adapter);
            if stateful {
                let state =
                    req.state_slot
                        .expect("a running request holds a state slot") as i32;
                plan.state_slots.push(state);
                if let Some(id) = req.restore_from {
                    plan.state_restores.extend([id as i32, state]);
                }
                for &(id, _) in &req.pending_saves {
                    plan.state_saves.extend([state, id as i32]);
                }
            }
            if let Some((src, n)) = req.kv_copy {
                debug_assert_eq!(start % bs, n, "the copy ends where the row starts");
                let dst = req.block_table[start / bs] as i64;
                let (src, bs64) = (src as i64, bs as i64);
                plan.kv_copy_src
                    .extend((0..n as i64).map(|i| src * bs64 + i));
                plan.kv_copy_dst
                    .extend((0..n as i64).map(|i| dst * bs64 + i));
            }
            plan.input_ids
                .extend(req.tokens[start..known_end].iter().map(|&t| t as i64));
            plan.input_ids.extend(req.draft.iter().map(|&t| t as i64));
            plan.draft_tokens.extend_from_slice(&req.draft);
            plan.positions.extend((start as i64)..(end as i64));
            for pos in start..end {
                let block = req.block_table[pos / bs] as i64;
                plan.slot_mapping
                    .push(block * bs as i64 + (pos % bs) as i64);
            }
            plan.block_table
                .extend(req.block_table.iter().map(|&b| b as i32));
            plan.block_table.resize((row + 1) * width, 0);
            if windowed {
                for pos in start..end {
                    let block = req.window_table[pos / bs] as i64;
                    plan.window_slot_mapping
                        .push(block * bs as i64 + (pos % bs) as i64);
                }
                plan.window_block_table
                    .extend(req.window_table.iter().map(|&b| {
                        if b == NULL_BLOCK {
                            0
                        } else {
                            b as i32
                        }
                    }));
                plan.window_block_table.resize((row + 1) * width, 0);
            }
            let qend = plan.input_ids.len() as i64;
            plan.query_start_loc.push(qend as i32);
            if known_end == req.num_tokens() {
                // Every draft position is sampled, and the one before them.
                for index in (qend - 1 - c.num_draft as i64)..qend {
                    plan.logits_indices.push(index);
                    plan.sample_rows.push(row as i32);
                }
            }
        }
        plan
    }
}
