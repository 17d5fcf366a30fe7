// SPDX-License-Identifier: Apache-2.0
//! `LayerSpec`: what one model layer keeps in the KV cache (full attention,
//! MLA, sliding window, chunked local attention, recurrent state, nothing),
//! over `kvport_layer_spec`. docs/hybrid-models.md has the design.

use std::ffi::{CStr, CString};
use std::os::raw::c_char;
use std::ptr;

use crate::config::KvCacheDtype;
use crate::error::{check, KvError};
use crate::ffi;

/// What a layer keeps (`kvport_layer_kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// K and V of every token.
    FullAttention,
    /// One latent vector per token, no V (DeepSeek's multi-head latent attention).
    Mla,
    /// K and V of the last `window` tokens.
    SlidingWindow,
    /// K and V of the current chunk of `chunk` tokens.
    ChunkedLocal,
    /// A fixed per-request state (linear attention, Mamba).
    State,
    /// No KV (an MLP-only layer).
    None,
}

impl LayerKind {
    pub fn as_raw(self) -> i32 {
        match self {
            LayerKind::FullAttention => ffi::KVPORT_LAYER_FULL_ATTENTION,
            LayerKind::Mla => ffi::KVPORT_LAYER_MLA,
            LayerKind::SlidingWindow => ffi::KVPORT_LAYER_SLIDING_WINDOW,
            LayerKind::ChunkedLocal => ffi::KVPORT_LAYER_CHUNKED_LOCAL,
            LayerKind::State => ffi::KVPORT_LAYER_STATE,
            LayerKind::None => ffi::KVPORT_LAYER_NONE,
        }
    }

    pub fn from_raw(raw: i32) -> Option<LayerKind> {
        Some(match raw {
            ffi::KVPORT_LAYER_FULL_ATTENTION => LayerKind::FullAttention,
            ffi::KVPORT_LAYER_MLA => LayerKind::Mla,
            ffi::KVPORT_LAYER_SLIDING_WINDOW => LayerKind::SlidingWindow,
            ffi::KVPORT_LAYER_CHUNKED_LOCAL => LayerKind::ChunkedLocal,
            ffi::KVPORT_LAYER_STATE => LayerKind::State,
            ffi::KVPORT_LAYER_NONE => LayerKind::None,
            _ => return None,
        })
    }
}

/// The in-cache format of an MLA latent (`kvport_mla_format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MlaFormat {
    /// `kv_lora_rank + rope_dim` values of the spec's dtype per token.
    Plain,
    /// vLLM's fp8_ds_mla: fp8 latent, fp32 scales, bf16 rope (656 bytes a
    /// token for 512 + 64).
    Fp8DsMla,
}

/// Element types of recurrent state (`kvport_state_dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StateDtype {
    F32,
    F16,
    Bf16,
}

impl StateDtype {
    pub fn as_raw(self) -> i32 {
        match self {
            StateDtype::F32 => ffi::KVPORT_STATE_F32,
            StateDtype::F16 => ffi::KVPORT_STATE_F16,
            StateDtype::Bf16 => ffi::KVPORT_STATE_BF16,
        }
    }

    pub fn from_raw(raw: i32) -> Option<StateDtype> {
        match raw {
            ffi::KVPORT_STATE_F32 => Some(StateDtype::F32),
            ffi::KVPORT_STATE_F16 => Some(StateDtype::F16),
            ffi::KVPORT_STATE_BF16 => Some(StateDtype::Bf16),
            _ => None,
        }
    }

    /// 4, 2 or 2.
    pub fn bytes(self) -> usize {
        match self {
            StateDtype::F32 => 4,
            StateDtype::F16 | StateDtype::Bf16 => 2,
        }
    }
}

/// One tensor of a layer's per-request state, e.g. Mamba2's SSM state
/// `[heads, head_dim, state_size]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateTensor {
    pub name: String,
    /// At most `ffi::KVPORT_STATE_MAX_DIMS` dimensions.
    pub shape: Vec<usize>,
    pub dtype: StateDtype,
}

impl StateTensor {
    pub fn new(name: &str, shape: &[usize], dtype: StateDtype) -> StateTensor {
        StateTensor { name: name.to_string(), shape: shape.to_vec(), dtype }
    }
}

/// The KV geometry of one layer (kvport::LayerSpec). Build one with the
/// named constructors; the fields a kind does not use stay 0 and are not
/// read by kvport.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerSpec {
    pub kind: LayerKind,
    pub num_kv_heads: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    /// Attention K/V and a plain MLA latent.
    pub dtype: KvCacheDtype,
    /// Sliding window: tokens attended (the token itself included).
    pub window: usize,
    /// Chunked local: tokens per chunk (a multiple of the block size).
    pub chunk: usize,
    pub kv_lora_rank: usize,
    pub rope_dim: usize,
    pub mla_format: MlaFormat,
    pub state: Vec<StateTensor>,
}

impl LayerSpec {
    fn empty(kind: LayerKind) -> LayerSpec {
        LayerSpec {
            kind,
            num_kv_heads: 0,
            head_dim_k: 0,
            head_dim_v: 0,
            dtype: KvCacheDtype::Bf16,
            window: 0,
            chunk: 0,
            kv_lora_rank: 0,
            rope_dim: 0,
            mla_format: MlaFormat::Plain,
            state: Vec::new(),
        }
    }

    pub fn full_attention(num_kv_heads: usize, head_dim_k: usize, head_dim_v: usize, dtype: KvCacheDtype) -> LayerSpec {
        LayerSpec { num_kv_heads, head_dim_k, head_dim_v, dtype, ..LayerSpec::empty(LayerKind::FullAttention) }
    }

    pub fn sliding_window(
        window: usize,
        num_kv_heads: usize,
        head_dim_k: usize,
        head_dim_v: usize,
        dtype: KvCacheDtype,
    ) -> LayerSpec {
        LayerSpec {
            kind: LayerKind::SlidingWindow,
            window,
            ..LayerSpec::full_attention(num_kv_heads, head_dim_k, head_dim_v, dtype)
        }
    }

    pub fn chunked_local(
        chunk: usize,
        num_kv_heads: usize,
        head_dim_k: usize,
        head_dim_v: usize,
        dtype: KvCacheDtype,
    ) -> LayerSpec {
        LayerSpec {
            kind: LayerKind::ChunkedLocal,
            chunk,
            ..LayerSpec::full_attention(num_kv_heads, head_dim_k, head_dim_v, dtype)
        }
    }

    /// DeepSeek-V3: `LayerSpec::mla(512, 64, KvCacheDtype::Bf16, MlaFormat::Plain)`.
    pub fn mla(kv_lora_rank: usize, rope_dim: usize, dtype: KvCacheDtype, format: MlaFormat) -> LayerSpec {
        LayerSpec { kv_lora_rank, rope_dim, dtype, mla_format: format, ..LayerSpec::empty(LayerKind::Mla) }
    }

    pub fn state(tensors: Vec<StateTensor>) -> LayerSpec {
        LayerSpec { state: tensors, ..LayerSpec::empty(LayerKind::State) }
    }

    /// A layer without KV.
    pub fn none() -> LayerSpec {
        LayerSpec::empty(LayerKind::None)
    }

    /// `InvalidArgument` naming the field when the spec is not valid with
    /// `block_size` (a zero size the kind needs, a chunk that is not a
    /// multiple of the block size, an fp8_ds_mla rank that is not a multiple
    /// of 128, a state without tensors, more than `KVPORT_STATE_MAX_DIMS`
    /// dimensions, ...).
    pub fn validate(&self, block_size: usize) -> Result<(), KvError> {
        with_c_specs(std::slice::from_ref(self), |s, _| check(unsafe { ffi::kvport_layer_spec_validate(s, block_size) }))
    }

    /// One line: "sliding_window(128) 8x64 bf16", "mla(512+64) bf16", ...
    pub fn describe(&self) -> Result<String, KvError> {
        with_c_specs(std::slice::from_ref(self), |s, _| {
            let mut needed = 0usize;
            check(unsafe { ffi::kvport_layer_spec_describe(s, ptr::null_mut(), 0, &mut needed) })?;
            let mut text = vec![0u8; needed.max(1)];
            check(unsafe { ffi::kvport_layer_spec_describe(s, text.as_mut_ptr() as *mut c_char, text.len(), ptr::null_mut()) })?;
            let len = text.iter().position(|&b| b == 0).unwrap_or(text.len());
            text.truncate(len);
            Ok(String::from_utf8_lossy(&text).into_owned())
        })
    }

    /// Bytes of one block of one layer (K + V, scales and padding; 0 for
    /// state and none).
    pub fn block_bytes(&self, block_size: usize) -> Result<usize, KvError> {
        let mut out = 0usize;
        with_c_specs(std::slice::from_ref(self), |s, _| {
            check(unsafe { ffi::kvport_layer_spec_block_bytes(s, block_size, &mut out) })
        })?;
        Ok(out)
    }

    /// Bytes of one request's state in one layer (every tensor padded to 16
    /// bytes); 0 for other kinds.
    pub fn state_bytes(&self) -> Result<usize, KvError> {
        let mut out = 0usize;
        with_c_specs(std::slice::from_ref(self), |s, _| check(unsafe { ffi::kvport_layer_spec_state_bytes(s, &mut out) }))?;
        Ok(out)
    }

    /// Offset of state tensor `index` in a state slot. `OutOfRange` for an
    /// index >= the tensor count.
    pub fn state_offset(&self, index: usize) -> Result<usize, KvError> {
        let mut out = 0usize;
        with_c_specs(std::slice::from_ref(self), |s, _| {
            check(unsafe { ffi::kvport_layer_spec_state_offset(s, index, &mut out) })
        })?;
        Ok(out)
    }

    /// The spec a C struct describes (its state names copied).
    pub(crate) fn from_c(c: &ffi::kvport_layer_spec) -> Result<LayerSpec, KvError> {
        let unknown = |what: &str, v: i32| KvError::Unknown(format!("kvport returned {} {}", what, v));
        let mut state = Vec::new();
        if c.num_state > 0 && !c.state.is_null() {
            // SAFETY: num_state entries that live as long as the cache.
            for t in unsafe { std::slice::from_raw_parts(c.state, c.num_state) } {
                let name = unsafe { CStr::from_ptr(t.name) }.to_string_lossy().into_owned();
                let ndim = t.ndim.min(ffi::KVPORT_STATE_MAX_DIMS);
                let dtype = StateDtype::from_raw(t.dtype).ok_or_else(|| unknown("state dtype", t.dtype))?;
                state.push(StateTensor { name, shape: t.shape[..ndim].to_vec(), dtype });
            }
        }
        Ok(LayerSpec {
            kind: LayerKind::from_raw(c.kind).ok_or_else(|| unknown("layer kind", c.kind))?,
            num_kv_heads: c.num_kv_heads,
            head_dim_k: c.head_dim_k,
            head_dim_v: c.head_dim_v,
            dtype: KvCacheDtype::from_raw(c.dtype).ok_or_else(|| unknown("dtype", c.dtype))?,
            window: c.window,
            chunk: c.chunk,
            kv_lora_rank: c.kv_lora_rank,
            rope_dim: c.rope_dim,
            mla_format: if c.mla_format == ffi::KVPORT_MLA_FP8_DS_MLA { MlaFormat::Fp8DsMla } else { MlaFormat::Plain },
            state,
        })
    }
}

/// Runs `f` with the specs as C structs (`ptr`, count), valid during the
/// call. A name with a NUL or a tensor of too many dimensions is
/// `InvalidArgument` before `f` runs.
pub(crate) fn with_c_specs<R>(
    specs: &[LayerSpec],
    f: impl FnOnce(*const ffi::kvport_layer_spec, usize) -> Result<R, KvError>,
) -> Result<R, KvError> {
    let mut names: Vec<Vec<CString>> = Vec::with_capacity(specs.len());
    let mut tensors: Vec<Vec<ffi::kvport_state_tensor>> = Vec::with_capacity(specs.len());
    for (i, s) in specs.iter().enumerate() {
        let mut n = Vec::with_capacity(s.state.len());
        let mut t = Vec::with_capacity(s.state.len());
        for (j, st) in s.state.iter().enumerate() {
            let name = CString::new(st.name.as_str())
                .map_err(|_| KvError::InvalidArgument(format!("specs[{}].state[{}].name {:?} has a NUL", i, j, st.name)))?;
            if st.shape.len() > ffi::KVPORT_STATE_MAX_DIMS {
                return Err(KvError::InvalidArgument(format!(
                    "specs[{}].state[{}].shape: {} dimensions, at most {}",
                    i,
                    j,
                    st.shape.len(),
                    ffi::KVPORT_STATE_MAX_DIMS
                )));
            }
            let mut shape = [0usize; ffi::KVPORT_STATE_MAX_DIMS];
            shape[..st.shape.len()].copy_from_slice(&st.shape);
            // The CString's buffer does not move when the CString does.
            t.push(ffi::kvport_state_tensor { name: name.as_ptr(), ndim: st.shape.len(), shape, dtype: st.dtype.as_raw() });
            n.push(name);
        }
        names.push(n);
        tensors.push(t);
    }
    let c: Vec<ffi::kvport_layer_spec> = specs
        .iter()
        .zip(&tensors)
        .map(|(s, t)| ffi::kvport_layer_spec {
            kind: s.kind.as_raw(),
            num_kv_heads: s.num_kv_heads,
            head_dim_k: s.head_dim_k,
            head_dim_v: s.head_dim_v,
            dtype: s.dtype.as_raw(),
            window: s.window,
            chunk: s.chunk,
            kv_lora_rank: s.kv_lora_rank,
            rope_dim: s.rope_dim,
            mla_format: match s.mla_format {
                MlaFormat::Plain => ffi::KVPORT_MLA_PLAIN,
                MlaFormat::Fp8DsMla => ffi::KVPORT_MLA_FP8_DS_MLA,
            },
            state: if t.is_empty() { ptr::null() } else { t.as_ptr() },
            num_state: t.len(),
        })
        .collect();
    let result = f(if c.is_empty() { ptr::null() } else { c.as_ptr() }, c.len());
    drop(names);
    result
}
