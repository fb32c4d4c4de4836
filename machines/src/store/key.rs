//! Store keys: one per (KV-cache group, block of the engine, shard of the
//! model's KV), and which rank of a replica set stores each.
//!
//! # Key format (version 1)
//!
//! The textual key is part of the interface: every engine that shares a
//! store must build the same key for the same bytes, and a store operator
//! may list or remove keys by prefix. Twelve fields separated by `:`:
//!
//! ```text
//! kvf1:{model}:{layout}:{dtype}:d{head_bytes}:{heads}:pp{pp_rank}of{pp_size}:{lora}:{extra}:g{group}:b{block_tokens}:{hash}
//! ```
//!
//! | field | value |
//! |---|---|
//! | `kvf1` | format name and version ([`KEY_FORMAT_VERSION`]); a new format gets a new version, so keys of two formats never meet |
//! | `model` | the model's name, escaped (below), 1 to [`NAME_BYTES_MAX`] bytes before escaping |
//! | `layout` | `hnd`, `nhd` or `mla` ([`LayoutKind`]) |
//! | `dtype` | the KV cache's element type as the engine names it (`bf16`, `fp8_e4m3`): 1 to [`DTYPE_BYTES_MAX`] of `[a-z0-9_]` |
//! | `d{head_bytes}` | bytes of one head of one token ([`ModelSpec::head_bytes`]) |
//! | `heads` | the KV heads whose bytes the value holds: `h{first}+{count}`, or `mla` (every rank holds the same latent) |
//! | `pp{r}of{s}` | pipeline stage `r` of `s` stages: which layers the value holds |
//! | `lora` | the LoRA adapter's name, escaped; empty without an adapter |
//! | `extra` | the engine's extra hash inputs (vLLM's `extra_keys`: cache salt, ...): their count, then `,` and each one escaped (`0`; `2,salt,x`) |
//! | `g{group}` | the KV-cache group |
//! | `b{block_tokens}` | tokens per block of that group |
//! | `hash` | the engine's block hash, lowercase hex (1 to [`BLOCK_HASH_BYTES_MAX`] bytes) |
//!
//! Escaping keeps `A-Z a-z 0-9 . _ -` and writes every other byte as `%`
//! and two uppercase hex digits, so no escaped field holds a `:` or a `,`
//! and `%` itself is escaped: splitting a key on `:` gives back the twelve
//! fields, and each field decodes to one value. Two different qualifier
//! tuples therefore never give the same key (`machines/tests/it/store_key.rs`
//! checks it by proptest). A key is at most [`KEY_BYTES_MAX`] bytes; a
//! [`Keyspace`] or [`RequestScope`] that could exceed it is refused when it
//! is made, so building a key afterwards cannot fail on length.
//!
//! # Shards and replicas
//!
//! A [`Shard`] is what one rank's value holds: a head slice and a pipeline
//! stage. When the model has fewer KV heads than the TP size, or uses MLA,
//! several ranks hold identical bytes: they form a replica set and share
//! the shard's keys, so a load works from any of them. Exactly one rank of
//! the set stores each key ([`Replica::stores`]): block `i` of group `g`
//! is stored by replica `(i + g) mod count`, which spreads consecutive
//! blocks over the replicas (the reference's `put_step` striding) and
//! depends only on the block's position, never on which blocks one save
//! happens to carry, so repeated saves of a prefix pick the same rank.

use std::fmt::Write as _;

use crate::layout::{LayoutKind, ModelSpec, RankLayout};

/// Version of the key format, written as the `kvf1` field.
pub const KEY_FORMAT_VERSION: u32 = 1;
/// Most bytes of a key.
pub const KEY_BYTES_MAX: usize = 1024;
/// Most bytes of a model or LoRA adapter name, before escaping.
pub const NAME_BYTES_MAX: usize = 128;
/// Most bytes of a dtype name.
pub const DTYPE_BYTES_MAX: usize = 16;
/// Most extra hash inputs of one request.
pub const EXTRA_KEYS_MAX: usize = 8;
/// Most bytes of one extra hash input, before escaping.
pub const EXTRA_KEY_BYTES_MAX: usize = 64;
/// Most bytes of a block hash (vLLM's sha256 hashes have 32).
pub const BLOCK_HASH_BYTES_MAX: usize = 32;
/// Most KV-cache groups of a keyspace.
pub const GROUPS_MAX: usize = 16;

/// Why a key or one of its qualifiers was refused.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// A name is empty or over [`NAME_BYTES_MAX`].
    #[error("{what} must be 1 to {NAME_BYTES_MAX} bytes, got {len_bytes}")]
    BadName {
        /// Which name.
        what: &'static str,
        /// Its length.
        len_bytes: usize,
    },
    /// The dtype is empty, too long or not `[a-z0-9_]`.
    #[error("dtype must be 1 to {DTYPE_BYTES_MAX} bytes of [a-z0-9_]")]
    BadDtype,
    /// More than [`EXTRA_KEYS_MAX`] extra hash inputs, or one over [`EXTRA_KEY_BYTES_MAX`].
    #[error("at most {EXTRA_KEYS_MAX} extra keys of at most {EXTRA_KEY_BYTES_MAX} bytes each")]
    BadExtraKeys,
    /// A block hash of no bytes or more than [`BLOCK_HASH_BYTES_MAX`].
    #[error("a block hash must be 1 to {BLOCK_HASH_BYTES_MAX} bytes, got {len_bytes}")]
    BadHash {
        /// Its length.
        len_bytes: usize,
    },
    /// The keys of this keyspace and scope could exceed [`KEY_BYTES_MAX`].
    #[error("keys could be {len_bytes} bytes, over the limit of {KEY_BYTES_MAX}")]
    TooLong {
        /// The longest key they could give.
        len_bytes: usize,
    },
    /// The TP or PP shape does not fit the model (zero sizes, a rank out of
    /// range, heads and TP size that do not divide one another).
    #[error("parallel shape does not fit the model: {0}")]
    BadShape(&'static str),
    /// No group, more than [`GROUPS_MAX`], or one of zero block tokens or
    /// of a sliding window of zero tokens.
    #[error("groups must be 1 to {GROUPS_MAX}, each of at least one block token and window token")]
    BadGroups,
    /// A key from a store that is empty, over [`KEY_BYTES_MAX`] or not
    /// printable ASCII.
    #[error("a stored key of {len_bytes} bytes is not a key")]
    BadStoredKey {
        /// Its length.
        len_bytes: usize,
    },
    /// A group index past the keyspace's groups.
    #[error("no KV-cache group {group}")]
    UnknownGroup {
        /// The index asked for.
        group: u32,
    },
}

/// An engine's block hash: the identity of a block's tokens and of every
/// block before it (vLLM chains them). Opaque bytes, 1 to
/// [`BLOCK_HASH_BYTES_MAX`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash {
    len: u8,
    bytes: [u8; BLOCK_HASH_BYTES_MAX],
}

impl BlockHash {
    /// A hash of the given bytes.
    pub fn from_bytes(b: &[u8]) -> Result<BlockHash, KeyError> {
        if b.is_empty() || b.len() > BLOCK_HASH_BYTES_MAX {
            return Err(KeyError::BadHash { len_bytes: b.len() });
        }
        let mut bytes = [0; BLOCK_HASH_BYTES_MAX];
        bytes[..b.len()].copy_from_slice(b);
        Ok(BlockHash {
            len: b.len() as u8,
            bytes,
        })
    }

    /// An integer hash (vLLM's `int` block hashes), as 8 big-endian bytes.
    pub fn from_u64(h: u64) -> BlockHash {
        let mut bytes = [0; BLOCK_HASH_BYTES_MAX];
        bytes[..8].copy_from_slice(&h.to_be_bytes());
        BlockHash { len: 8, bytes }
    }

    /// The hash's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
}

impl std::fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BlockHash(")?;
        for b in self.as_bytes() {
            write!(f, "{b:02x}")?;
        }
        f.write_str(")")
    }
}

/// One KV-cache group as the store sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GroupSpec {
    /// Tokens per block of this group.
    pub block_tokens: u32,
    /// Sliding-window attention: a token attends to itself and the
    /// `window - 1` tokens before it. `None` for full attention.
    pub window_tokens: Option<u32>,
}

/// What an engine's keys have in common, whatever the rank or request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyspaceSpec {
    /// The model's name (vLLM uses the last path component of the model).
    pub model_name: String,
    /// Layout, KV heads and head bytes of the model.
    pub model: ModelSpec,
    /// The KV cache's element type (`bf16`, `fp8_e4m3`).
    pub dtype: String,
    /// Tensor-parallel size of the engine.
    pub tp_size: u32,
    /// Pipeline-parallel size of the engine.
    pub pp_size: u32,
    /// The engine's KV-cache groups, by group id.
    pub groups: Vec<GroupSpec>,
}

/// Which KV heads a value holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HeadSlice {
    /// `count` heads from `first` (HND and NHD layouts).
    Heads {
        /// The first head.
        first: u32,
        /// How many heads.
        count: u32,
    },
    /// The latent of an MLA model: the same on every rank.
    Latent,
}

/// What one rank's value of a block holds: a head slice of one stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Shard {
    /// The heads.
    pub heads: HeadSlice,
    /// The pipeline stage (the layers).
    pub pp_rank: u32,
}

/// A rank's place in the set of ranks that hold the same shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Replica {
    /// Ranks holding the shard (1 when nothing is replicated).
    pub count: u32,
    /// This rank's index among them.
    pub index: u32,
}

impl Replica {
    /// True when this rank stores block `index` of group `group` (see the
    /// module docs): exactly one replica of a set does.
    pub fn stores(&self, group: u32, index: u32) -> bool {
        let count = u64::from(self.count.max(1));
        (u64::from(index) + u64::from(group)) % count == u64::from(self.index)
    }
}

/// The validated, engine-wide part of every key. See the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keyspace {
    /// `kvf1:{model}:{layout}:{dtype}:d{head_bytes}`.
    prefix: String,
    model: ModelSpec,
    tp_size: u32,
    pp_size: u32,
    groups: Vec<GroupSpec>,
}

/// The validated, per-request part of a key: LoRA adapter and extra hash
/// inputs, already escaped (`{lora}:{extra}`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RequestScope {
    text: String,
}

/// A store key (see the module docs for its format).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkKey(String);

impl ChunkKey {
    /// The key's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A key a store handed back (a removed or listed key): 1 to
    /// [`KEY_BYTES_MAX`] bytes of printable ASCII without spaces, the
    /// alphabet of every key [`Keyspace::key`] makes. Whether it is one of
    /// this keyspace's keys is the caller's to check.
    pub fn from_stored(text: String) -> Result<ChunkKey, KeyError> {
        let printable = text.bytes().all(|b| b.is_ascii_graphic());
        if text.is_empty() || text.len() > KEY_BYTES_MAX || !printable {
            return Err(KeyError::BadStoredKey {
                len_bytes: text.len(),
            });
        }
        Ok(ChunkKey(text))
    }
}

impl std::fmt::Debug for ChunkKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::fmt::Display for ChunkKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Appends `s` escaped: `A-Z a-z 0-9 . _ -` kept, any other byte `%XX`.
fn escape(s: &str, out: &mut String) {
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
}

/// What every key of the model `model_name` starts with, whatever its
/// layout, dtype, shard or group: `kvf1:{escaped model}:`. A store cleared
/// of the keys with this prefix forgets this model and no other.
pub fn model_key_prefix(model_name: &str) -> Result<String, KeyError> {
    check_name("model name", model_name)?;
    let mut prefix = format!("kvf{KEY_FORMAT_VERSION}:");
    escape(model_name, &mut prefix);
    prefix.push(':');
    Ok(prefix)
}

fn check_name(what: &'static str, s: &str) -> Result<(), KeyError> {
    if s.is_empty() || s.len() > NAME_BYTES_MAX {
        return Err(KeyError::BadName {
            what,
            len_bytes: s.len(),
        });
    }
    Ok(())
}

fn layout_name(l: LayoutKind) -> &'static str {
    match l {
        LayoutKind::Hnd => "hnd",
        LayoutKind::Nhd => "nhd",
        LayoutKind::Mla => "mla",
    }
}

/// Decimal digits of the largest `u32`.
const U32_DIGITS: usize = 10;
/// The longest shard field pair: `:h{u32}+{u32}:pp{u32}of{u32}`.
const SHARD_BYTES_MAX: usize =
    1 + 1 + U32_DIGITS + 1 + U32_DIGITS + 1 + 2 + U32_DIGITS + 2 + U32_DIGITS;
/// The longest tail after the scope: `:g{u32}:b{u32}:{hex hash}`.
const TAIL_BYTES_MAX: usize = 2 + U32_DIGITS + 2 + U32_DIGITS + 1 + 2 * BLOCK_HASH_BYTES_MAX;

impl Keyspace {
    /// Validates `spec` and fixes the engine-wide part of its keys.
    pub fn new(spec: &KeyspaceSpec) -> Result<Keyspace, KeyError> {
        check_name("model name", &spec.model_name)?;
        let dtype_ok = !spec.dtype.is_empty()
            && spec.dtype.len() <= DTYPE_BYTES_MAX
            && (spec.dtype.bytes())
                .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase() || b == b'_');
        if !dtype_ok {
            return Err(KeyError::BadDtype);
        }
        if spec.groups.is_empty()
            || spec.groups.len() > GROUPS_MAX
            || (spec.groups.iter()).any(|g| g.block_tokens == 0 || g.window_tokens == Some(0))
        {
            return Err(KeyError::BadGroups);
        }
        check_shape(&spec.model, spec.tp_size, spec.pp_size)?;
        let mut prefix = format!("kvf{KEY_FORMAT_VERSION}:");
        escape(&spec.model_name, &mut prefix);
        let layout = layout_name(spec.model.layout);
        let _ = write!(
            prefix,
            ":{layout}:{}:d{}",
            spec.dtype, spec.model.head_bytes
        );
        Ok(Keyspace {
            prefix,
            model: spec.model,
            tp_size: spec.tp_size,
            pp_size: spec.pp_size,
            groups: spec.groups.clone(),
        })
    }

    /// The engine's KV-cache groups, by group id.
    pub fn groups(&self) -> &[GroupSpec] {
        &self.groups
    }

    /// Tensor-parallel size.
    pub fn tp_size(&self) -> u32 {
        self.tp_size
    }

    /// Pipeline-parallel size.
    pub fn pp_size(&self) -> u32 {
        self.pp_size
    }

    /// The per-request part of keys: the LoRA adapter and the engine's
    /// extra hash inputs. Refused when a key could exceed [`KEY_BYTES_MAX`].
    pub fn scope(&self, lora: Option<&str>, extra_keys: &[&str]) -> Result<RequestScope, KeyError> {
        let mut text = String::new();
        if let Some(name) = lora {
            check_name("LoRA adapter name", name)?;
            escape(name, &mut text);
        }
        if extra_keys.len() > EXTRA_KEYS_MAX
            || extra_keys.iter().any(|e| e.len() > EXTRA_KEY_BYTES_MAX)
        {
            return Err(KeyError::BadExtraKeys);
        }
        let _ = write!(text, ":{}", extra_keys.len());
        for e in extra_keys {
            text.push(',');
            escape(e, &mut text);
        }
        let len_bytes = self.prefix.len() + SHARD_BYTES_MAX + 1 + text.len() + TAIL_BYTES_MAX;
        if len_bytes > KEY_BYTES_MAX {
            return Err(KeyError::TooLong { len_bytes });
        }
        Ok(RequestScope { text })
    }

    /// The shard held by rank `tp_rank` of stage `pp_rank`, and its place
    /// among the ranks holding the same shard.
    pub fn shard_of(&self, tp_rank: u32, pp_rank: u32) -> Result<(Shard, Replica), KeyError> {
        if tp_rank >= self.tp_size || pp_rank >= self.pp_size {
            return Err(KeyError::BadShape("rank out of range"));
        }
        let (heads, replica) = match self.model.layout {
            LayoutKind::Mla => (
                HeadSlice::Latent,
                Replica {
                    count: self.tp_size,
                    index: tp_rank,
                },
            ),
            LayoutKind::Hnd | LayoutKind::Nhd => {
                let h = self.model.total_kv_heads;
                let count = (self.tp_size / h).max(1);
                let slice = HeadSlice::Heads {
                    first: self.model.first_head(self.tp_size, tp_rank),
                    count: self.model.heads_per_rank(self.tp_size),
                };
                let replica = Replica {
                    count,
                    index: tp_rank % count,
                };
                (slice, replica)
            }
        };
        Ok((Shard { heads, pp_rank }, replica))
    }

    /// [`Keyspace::shard_of`] for a rank described by its layout, which
    /// must belong to this engine's TP and PP sizes.
    pub fn shard_of_layout(&self, layout: &RankLayout) -> Result<(Shard, Replica), KeyError> {
        if layout.tp_size != self.tp_size || layout.stage.pp_size != self.pp_size {
            return Err(KeyError::BadShape(
                "the rank's TP or PP size is not the keyspace's",
            ));
        }
        self.shard_of(layout.tp_rank, layout.stage.pp_rank)
    }

    /// Every distinct shard of the engine, in rank order: what a lookup
    /// must find stored for a block to count.
    pub fn shards(&self) -> Vec<Shard> {
        let mut out = Vec::new();
        for pp in 0..self.pp_size {
            for tp in 0..self.tp_size {
                // Ranks and stages are in range by construction.
                if let Ok((s, r)) = self.shard_of(tp, pp) {
                    if r.index == 0 {
                        out.push(s);
                    }
                }
            }
        }
        out
    }

    /// The key of block hash `hash` of group `group` in `shard`.
    pub fn key(
        &self,
        shard: &Shard,
        scope: &RequestScope,
        group: u32,
        hash: &BlockHash,
    ) -> Result<ChunkKey, KeyError> {
        let spec = (self.groups.get(group as usize)).ok_or(KeyError::UnknownGroup { group })?;
        let mut k = String::with_capacity(
            self.prefix.len() + 48 + scope.text.len() + 2 * hash.len as usize,
        );
        k.push_str(&self.prefix);
        match shard.heads {
            HeadSlice::Heads { first, count } => {
                let _ = write!(k, ":h{first}+{count}");
            }
            HeadSlice::Latent => k.push_str(":mla"),
        }
        let _ = write!(k, ":pp{}of{}:{}", shard.pp_rank, self.pp_size, scope.text);
        let _ = write!(k, ":g{group}:b{}:", spec.block_tokens);
        for b in hash.as_bytes() {
            let _ = write!(k, "{b:02x}");
        }
        debug_assert!(k.len() <= KEY_BYTES_MAX, "scope() bounds every key");
        Ok(ChunkKey(k))
    }
}

/// Checks that TP and PP sizes fit the model: heads and TP size divide one
/// another (vLLM's rule), sizes are not zero.
fn check_shape(model: &ModelSpec, tp_size: u32, pp_size: u32) -> Result<(), KeyError> {
    if tp_size == 0 || pp_size == 0 {
        return Err(KeyError::BadShape("zero TP or PP size"));
    }
    match model.layout {
        LayoutKind::Mla => Ok(()),
        LayoutKind::Hnd | LayoutKind::Nhd => {
            let h = model.total_kv_heads;
            if h == 0 {
                Err(KeyError::BadShape("no KV heads"))
            } else if !h.is_multiple_of(tp_size) && !tp_size.is_multiple_of(h) {
                Err(KeyError::BadShape(
                    "KV heads and TP size do not divide one another",
                ))
            } else {
                Ok(())
            }
        }
    }
}
