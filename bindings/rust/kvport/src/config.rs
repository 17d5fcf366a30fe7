// SPDX-License-Identifier: Apache-2.0
//! `KvCacheConfig`, `KvCacheDtype`, `KvCacheLayout`, `RegionLayout`.

use std::ffi::{CStr, CString};
use std::fmt;
use std::ptr;

use crate::error::{check, KvError};
use crate::ffi;

/// Element format of a cache (kvport::KvCacheDtype; same values as
/// `kvport_dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvCacheDtype {
    F16,
    Bf16,
    Fp8E4m3,
    Fp8E5m2,
    Nvfp4,
    Turbo2,
    Turbo3,
    Turbo4,
    Turbo8,
}

impl KvCacheDtype {
    pub const ALL: [KvCacheDtype; 9] = [
        KvCacheDtype::F16,
        KvCacheDtype::Bf16,
        KvCacheDtype::Fp8E4m3,
        KvCacheDtype::Fp8E5m2,
        KvCacheDtype::Nvfp4,
        KvCacheDtype::Turbo2,
        KvCacheDtype::Turbo3,
        KvCacheDtype::Turbo4,
        KvCacheDtype::Turbo8,
    ];

    /// The `kvport_dtype` value.
    pub fn as_raw(self) -> i32 {
        match self {
            KvCacheDtype::F16 => ffi::KVPORT_DTYPE_F16,
            KvCacheDtype::Bf16 => ffi::KVPORT_DTYPE_BF16,
            KvCacheDtype::Fp8E4m3 => ffi::KVPORT_DTYPE_FP8_E4M3,
            KvCacheDtype::Fp8E5m2 => ffi::KVPORT_DTYPE_FP8_E5M2,
            KvCacheDtype::Nvfp4 => ffi::KVPORT_DTYPE_NVFP4,
            KvCacheDtype::Turbo2 => ffi::KVPORT_DTYPE_TURBO2,
            KvCacheDtype::Turbo3 => ffi::KVPORT_DTYPE_TURBO3,
            KvCacheDtype::Turbo4 => ffi::KVPORT_DTYPE_TURBO4,
            KvCacheDtype::Turbo8 => ffi::KVPORT_DTYPE_TURBO8,
        }
    }

    /// The dtype of a `kvport_dtype` value; `None` outside the enum.
    pub fn from_raw(raw: i32) -> Option<KvCacheDtype> {
        KvCacheDtype::ALL.iter().copied().find(|d| d.as_raw() == raw)
    }

    /// "f16", "bf16", "fp8_e4m3", ... (kvport_dtype_name).
    pub fn name(self) -> &'static str {
        // SAFETY: non-null for every value of the enum; static storage.
        let p = unsafe { ffi::kvport_dtype_name(self.as_raw()) };
        assert!(!p.is_null(), "kvport_dtype_name({}) returned null", self.as_raw());
        unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("?")
    }

    /// Parses "f16", "bf16", "fp16", "bfloat16", "fp8", "nvfp4", ...
    pub fn from_name(name: &str) -> Result<KvCacheDtype, KvError> {
        let c = CString::new(name)
            .map_err(|_| KvError::InvalidArgument(format!("dtype name {:?} has a NUL", name)))?;
        let mut raw = 0i32;
        check(unsafe { ffi::kvport_dtype_from_name(c.as_ptr(), &mut raw) })?;
        KvCacheDtype::from_raw(raw)
            .ok_or_else(|| KvError::Unknown(format!("kvport returned dtype value {}", raw)))
    }
}

impl fmt::Display for KvCacheDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Pool layout (kvport::KvCacheLayout).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvCacheLayout {
    /// One K pool and one V pool per layer (the reference's layout).
    LayerMajor,
    /// One pool; block b holds every layer's K and V contiguously.
    BlockMajor,
}

impl KvCacheLayout {
    pub fn as_raw(self) -> i32 {
        match self {
            KvCacheLayout::LayerMajor => ffi::KVPORT_LAYOUT_LAYER_MAJOR,
            KvCacheLayout::BlockMajor => ffi::KVPORT_LAYOUT_BLOCK_MAJOR,
        }
    }

    pub fn from_raw(raw: i32) -> Option<KvCacheLayout> {
        match raw {
            ffi::KVPORT_LAYOUT_LAYER_MAJOR => Some(KvCacheLayout::LayerMajor),
            ffi::KVPORT_LAYOUT_BLOCK_MAJOR => Some(KvCacheLayout::BlockMajor),
            _ => None,
        }
    }
}

/// A cache's shape (kvport::KvCacheConfig): the reference's config fields
/// that kvport has (`num_layers`, `block_size`, `dtype`, `layer_dtypes`,
/// heads and head dims), plus the pool layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvCacheConfig {
    pub num_layers: usize,
    /// Tokens per block.
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim_k: usize,
    /// 0: K-only layers (MLA's latent, state slots): no V pools. The V
    /// pointer and stride calls then return `KvError::InvalidArgument`,
    /// `v_block_bytes_for_layer` is 0, `read_block` returns an empty V and
    /// `write_block` takes `&[]` for it.
    pub head_dim_v: usize,
    pub dtype: KvCacheDtype,
    /// Per-layer dtype override (mixed precision): empty, or exactly
    /// `num_layers` entries.
    pub layer_dtypes: Vec<KvCacheDtype>,
    pub layout: KvCacheLayout,
}

impl Default for KvCacheConfig {
    /// kvport's defaults (`kvport_config_init`): sizes 0, block_size 16,
    /// bf16, layer-major, no per-layer dtypes.
    fn default() -> Self {
        KvCacheConfig {
            num_layers: 0,
            block_size: 16,
            num_kv_heads: 0,
            head_dim_k: 0,
            head_dim_v: 0,
            dtype: KvCacheDtype::Bf16,
            layer_dtypes: Vec::new(),
            layout: KvCacheLayout::LayerMajor,
        }
    }
}

impl KvCacheConfig {
    /// A layer-major config with one head_dim for K and V.
    pub fn new(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        block_size: usize,
        dtype: KvCacheDtype,
    ) -> Self {
        KvCacheConfig {
            num_layers,
            block_size,
            num_kv_heads,
            head_dim_k: head_dim,
            head_dim_v: head_dim,
            dtype,
            ..KvCacheConfig::default()
        }
    }

    /// Whether the layers have a V part (`head_dim_v > 0`).
    pub fn has_v(&self) -> bool {
        self.head_dim_v != 0
    }

    /// Calls `f` with the C view of this config (valid during the call).
    pub(crate) fn with_c<R>(&self, f: impl FnOnce(&ffi::kvport_config) -> R) -> R {
        let layer_dtypes: Vec<i32> = self.layer_dtypes.iter().map(|d| d.as_raw()).collect();
        let c = ffi::kvport_config {
            num_layers: self.num_layers,
            block_size: self.block_size,
            num_kv_heads: self.num_kv_heads,
            head_dim_k: self.head_dim_k,
            head_dim_v: self.head_dim_v,
            dtype: self.dtype.as_raw(),
            layout: self.layout.as_raw(),
            layer_dtypes: if layer_dtypes.is_empty() {
                ptr::null()
            } else {
                layer_dtypes.as_ptr()
            },
            num_layer_dtypes: layer_dtypes.len(),
        };
        f(&c)
    }

    /// `Err(InvalidArgument)` naming the field for a zero size, a
    /// layer_dtypes of the wrong length, a head_dim that is not a multiple of
    /// a packed dtype's group, or an overflow.
    /// The config a C struct describes (per-layer dtypes copied).
    pub(crate) fn from_c(c: &ffi::kvport_config) -> Result<KvCacheConfig, KvError> {
        let dtype = |raw: i32| {
            KvCacheDtype::from_raw(raw).ok_or_else(|| KvError::Unknown(format!("kvport returned dtype {}", raw)))
        };
        let mut layer_dtypes = Vec::new();
        if c.num_layer_dtypes > 0 && !c.layer_dtypes.is_null() {
            // SAFETY: num_layer_dtypes values that live as long as the cache.
            for &d in unsafe { std::slice::from_raw_parts(c.layer_dtypes, c.num_layer_dtypes) } {
                layer_dtypes.push(dtype(d)?);
            }
        }
        Ok(KvCacheConfig {
            num_layers: c.num_layers,
            block_size: c.block_size,
            num_kv_heads: c.num_kv_heads,
            head_dim_k: c.head_dim_k,
            head_dim_v: c.head_dim_v,
            dtype: dtype(c.dtype)?,
            layer_dtypes,
            layout: KvCacheLayout::from_raw(c.layout)
                .ok_or_else(|| KvError::Unknown(format!("kvport returned layout {}", c.layout)))?,
        })
    }

    pub fn validate(&self) -> Result<(), KvError> {
        self.with_c(|c| check(unsafe { ffi::kvport_config_validate(c) }))
    }

    /// Bytes one block costs across all layers, K + V.
    pub fn bytes_per_block(&self) -> Result<usize, KvError> {
        let mut out = 0usize;
        self.with_c(|c| check(unsafe { ffi::kvport_config_bytes_per_block(c, &mut out) }))?;
        Ok(out)
    }

    /// The reference's name for `bytes_per_block`.
    pub fn block_bytes_kv_all_layers(&self) -> Result<usize, KvError> {
        self.bytes_per_block()
    }

    /// The dtype of `layer` (`layer_dtypes[layer]` or `dtype`).
    pub fn dtype_for_layer(&self, layer: usize) -> Result<KvCacheDtype, KvError> {
        if layer >= self.num_layers {
            return Err(KvError::OutOfRange(format!(
                "layer {} >= num_layers {}",
                layer, self.num_layers
            )));
        }
        Ok(self.layer_dtypes.get(layer).copied().unwrap_or(self.dtype))
    }
}

/// Byte layout of the K (or V) part of one block of one layer
/// (kvport::BlockRegionLayout): `[ data | pad to 16 B | scales | pad ]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RegionLayout {
    pub data_bytes: usize,
    pub data_padding: usize,
    pub scale_offset: usize,
    pub scale_bytes: usize,
    pub scale_padding: usize,
    pub total_bytes: usize,
}

impl From<ffi::kvport_region_layout> for RegionLayout {
    fn from(r: ffi::kvport_region_layout) -> Self {
        RegionLayout {
            data_bytes: r.data_bytes,
            data_padding: r.data_padding,
            scale_offset: r.scale_offset,
            scale_bytes: r.scale_bytes,
            scale_padding: r.scale_padding,
            total_bytes: r.total_bytes,
        }
    }
}

impl RegionLayout {
    /// The layout of a region of `block_size` tokens x `num_kv_heads` x
    /// `head_dim` elements of `dtype` (kvport_block_region_layout).
    pub fn new(
        dtype: KvCacheDtype,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> Result<RegionLayout, KvError> {
        let mut out = ffi::kvport_region_layout::default();
        check(unsafe {
            ffi::kvport_block_region_layout(dtype.as_raw(), block_size, num_kv_heads, head_dim, &mut out)
        })?;
        Ok(out.into())
    }
}
