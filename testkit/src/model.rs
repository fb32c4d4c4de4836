//! The model shapes the tests and benches share, written once: a
//! test starts from one of them and names what it changes
//! (`model::small().with_heads(2)`), so the shape a test relies on shows at
//! the test and a new [`ModelSpec`] field is given its value here only.
//!
//! The machines crate's tests compile this file from its path: the test
//! kit depends on that crate, so they cannot depend on the test kit. It
//! therefore uses nothing but `kvferry_machines`.

use kvferry_machines::internal::store::{GroupSpec, KeyspaceSpec};
use kvferry_machines::{LayoutKind, ModelSpec};

/// HND, 4 KV heads, 4-token blocks, 32-byte heads: the end-to-end tests'
/// model. Its 512-byte blocks keep clusters cheap, and 4 heads split
/// evenly over TP 1, 2 and 4. The other shapes are written as changes to
/// this one, so a new [`ModelSpec`] field takes its value from here.
pub const fn small() -> ModelSpec {
    ModelSpec {
        layout: LayoutKind::Hnd,
        total_kv_heads: 4,
        block_tokens: 4,
        head_bytes: 32,
    }
}

/// HND, 8 KV heads, 16-token blocks, 128-byte heads: the CLI's default
/// model (`kvferry demo` and the rank commands without shape options; a
/// test of the CLI keeps the two the same).
pub const fn medium() -> ModelSpec {
    ModelSpec {
        total_kv_heads: 8,
        block_tokens: 16,
        head_bytes: 128,
        ..small()
    }
}

/// HND, 8 KV heads, 16-token blocks, 256-byte heads (head dimension 128
/// in bf16): a production-sized model, as Llama 3 8B in vLLM.
pub const fn large() -> ModelSpec {
    ModelSpec {
        head_bytes: 256,
        ..medium()
    }
}

/// MLA, one 64-byte latent per token, in [`medium`]'s 16-token blocks.
pub const fn mla() -> ModelSpec {
    ModelSpec {
        layout: LayoutKind::Mla,
        total_kv_heads: 1,
        head_bytes: 64,
        ..medium()
    }
}

/// HND, one head, one-token blocks of `block_bytes` bytes: a block is just
/// bytes, for tests of what moves them rather than of the layout.
pub const fn flat(block_bytes: u64) -> ModelSpec {
    ModelSpec {
        total_kv_heads: 1,
        block_tokens: 1,
        head_bytes: block_bytes,
        ..small()
    }
}

/// Named changes to a shape: each returns the model with one field set.
pub trait ModelSpecExt {
    /// With byte order `layout`.
    fn with_layout(self, layout: LayoutKind) -> Self;
    /// With `heads` KV heads in all (before tensor parallelism).
    fn with_heads(self, heads: u32) -> Self;
    /// With `block_tokens` tokens per block.
    fn with_block_tokens(self, block_tokens: u32) -> Self;
    /// With `head_bytes` bytes per head per token.
    fn with_head_bytes(self, head_bytes: u64) -> Self;
}

impl ModelSpecExt for ModelSpec {
    fn with_layout(mut self, layout: LayoutKind) -> Self {
        self.layout = layout;
        self
    }

    fn with_heads(mut self, heads: u32) -> Self {
        self.total_kv_heads = heads;
        self
    }

    fn with_block_tokens(mut self, block_tokens: u32) -> Self {
        self.block_tokens = block_tokens;
        self
    }

    fn with_head_bytes(mut self, head_bytes: u64) -> Self {
        self.head_bytes = head_bytes;
        self
    }
}

/// The store keyspace of `model` named `name`: bf16, no tensor or
/// pipeline parallelism, one full-attention group of the model's blocks.
pub fn keyspace(name: &str, model: ModelSpec) -> KeyspaceSpec {
    KeyspaceSpec {
        model_name: name.into(),
        model,
        dtype: "bf16".into(),
        tp_size: 1,
        pp_size: 1,
        groups: vec![GroupSpec {
            block_tokens: model.block_tokens,
            window_tokens: None,
        }],
    }
}
