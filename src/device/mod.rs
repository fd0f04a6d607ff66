//! Devices and tensors.
//!
//! Owns: the [`Device`] handle (CPU thread pool, or a CUDA context), the [`Tensor`] type with its
//! storage, and host<->device copies; the CUDA device on a GPU or on the simulator. May call:
//! `rayon`, `cudarc` (feature `cuda`), the simulator's kernel library.
//! Must not: know about quantization, ops, models or anything above them (the op rooms of
//! `ops` dispatch on [`Device`]; this layer imports only `util`, `rand` and `formats`).

pub mod cpu;
pub mod cuda;
mod tensor;

pub use cpu::CpuDevice;
pub use cuda::CudaDevice;
pub use tensor::{bf16_rne, CpuFloats, CpuStorage, DType, Storage, Tensor};

use anyhow::Result;

/// A device as a config or a flag spells it, checked without opening anything: `cpu`,
/// `cpu:<threads>`, `cuda`, `cuda:<ordinal>`, `cuda-sim` or `cuda-sim:<ordinal>` (the
/// simulated GPU: the CUDA glue and kernels on the host).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    /// `threads`: None for `cpu` (all cores, or the run's share of them).
    Cpu { threads: Option<usize> },
    /// `ordinal`: None for `cuda` (the first GPU, or every visible one for a run).
    Cuda { ordinal: Option<usize> },
    /// `ordinal`: None for `cuda-sim` (the first simulated GPU, or every one for a run).
    CudaSim { ordinal: Option<usize> },
}

impl DeviceSpec {
    pub fn parse(spec: &str) -> Result<DeviceSpec> {
        let spec = spec.trim();
        match spec {
            "cpu" => return Ok(DeviceSpec::Cpu { threads: None }),
            "cuda" => return Ok(DeviceSpec::Cuda { ordinal: None }),
            "cuda-sim" => return Ok(DeviceSpec::CudaSim { ordinal: None }),
            _ => {}
        }
        if let Some(n) = spec.strip_prefix("cpu:") {
            let n: usize =
                n.parse().map_err(|_| anyhow::anyhow!("device '{spec}': expected cpu:<threads>, e.g. cpu:4"))?;
            return Ok(DeviceSpec::Cpu { threads: Some(n) });
        }
        if let Some(k) = spec.strip_prefix("cuda-sim:") {
            let k: usize = k
                .parse()
                .map_err(|_| anyhow::anyhow!("device '{spec}': expected cuda-sim:<ordinal>, e.g. cuda-sim:0"))?;
            return Ok(DeviceSpec::CudaSim { ordinal: Some(k) });
        }
        if let Some(k) = spec.strip_prefix("cuda:") {
            let k: usize =
                k.parse().map_err(|_| anyhow::anyhow!("device '{spec}': expected cuda:<ordinal>, e.g. cuda:0"))?;
            return Ok(DeviceSpec::Cuda { ordinal: Some(k) });
        }
        anyhow::bail!(
            "device '{spec}': expected 'cpu', 'cpu:<threads>', 'cuda', 'cuda:<ordinal>', 'cuda-sim' or \
             'cuda-sim:<ordinal>'"
        )
    }
}

/// A compute device. Cheap to clone (handles are reference counted).
#[derive(Clone, Debug)]
pub enum Device {
    Cpu(CpuDevice),
    Cuda(CudaDevice),
}

impl Device {
    /// A CPU device using `threads` worker threads (0: all available cores).
    pub fn cpu(threads: usize) -> Result<Device> {
        Ok(Device::Cpu(CpuDevice::new(threads, None)?))
    }

    /// CUDA device `ordinal`; fails with a clear message when built without `--features cuda`
    /// or when no driver/GPU is present.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        Ok(Device::Cuda(CudaDevice::new(ordinal)?))
    }

    /// Parses `cpu`, `cpu:N` (N threads), `cuda`, `cuda:K`, `cuda-sim` or `cuda-sim:K` and opens
    /// that device.
    pub fn parse(spec: &str) -> Result<Device> {
        match DeviceSpec::parse(spec)? {
            DeviceSpec::Cpu { threads } => Device::cpu(threads.unwrap_or(0)),
            DeviceSpec::Cuda { ordinal } => Device::cuda(ordinal.unwrap_or(0)),
            DeviceSpec::CudaSim { ordinal } => {
                static ONCE: std::sync::Once = std::sync::Once::new();
                let d = CudaDevice::sim(ordinal.unwrap_or(0))?;
                ONCE.call_once(|| {
                    eprintln!(
                        "note: {} is a simulated GPU (the CUDA glue and kernels run on the host): not a GPU run",
                        d.name()
                    )
                });
                Ok(Device::Cuda(d))
            }
        }
    }

    /// The memory this device may use for a run's plan: a CUDA device's allocator budget (from
    /// its free memory when opened); None on CPU (host memory has no budget of its own).
    pub fn memory_budget(&self) -> Option<usize> {
        match self {
            Device::Cpu(_) => None,
            Device::Cuda(c) => Some(c.memory().3),
        }
    }

    /// Hands the memory this device's allocator caches back to the driver (CUDA); the bytes
    /// returned. Host memory is freed when its tensors drop: 0 on CPU.
    pub fn release_cached(&self) -> Result<usize> {
        match self {
            Device::Cpu(_) => Ok(0),
            Device::Cuda(c) => c.release_cached(),
        }
    }

    pub fn name(&self) -> String {
        match self {
            Device::Cpu(c) => format!("cpu ({} threads)", c.threads()),
            Device::Cuda(c) => c.name(),
        }
    }

    pub fn is_cpu(&self) -> bool {
        matches!(self, Device::Cpu(_))
    }

    /// Allocates a zero-filled tensor on this device.
    pub fn zeros(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        match self {
            Device::Cpu(_) => Ok(Tensor::cpu_zeros(dtype, shape)),
            Device::Cuda(c) => c.zeros(dtype, shape),
        }
    }

    /// A tensor the caller overwrites completely before reading it (an activation a kernel
    /// writes whole): zeros on the CPU, no memset on a GPU, poison on cuda-sim
    /// ([`cuda::CudaDevice::uninit`]). Anything accumulated into (a gradient) takes
    /// [`Device::zeros`].
    pub fn uninit(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        match self {
            Device::Cpu(_) => Ok(Tensor::cpu_zeros(dtype, shape)),
            Device::Cuda(c) => c.uninit(dtype, shape),
        }
    }

    /// [`Device::zeros`] for a long-lived buffer the hot loop writes bit by bit (the KV cache):
    /// on the CPU its pages are committed now ([`Tensor::cpu_zeros_committed`]), so the whole
    /// buffer is resident from the start; device memory is backed when allocated anyway.
    pub fn zeros_committed(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        match self {
            Device::Cpu(_) => Ok(Tensor::cpu_zeros_committed(dtype, shape)),
            Device::Cuda(c) => c.zeros(dtype, shape),
        }
    }

    /// Zero-filled tensors of `parts` ((dtype, shape) each) whose memory can be handed back
    /// between phases and taken again at the same addresses: on CUDA one virtual-memory
    /// reservation holds them all, and its handle comes first ([`Device::unmap`],
    /// [`Device::remap`]; `cuda::CudaDevice::remappable`). None on the CPU, whose tensors are
    /// handed back by dropping them. `what` names the buffer in errors.
    pub fn remappable(&self, parts: &[(DType, Vec<usize>)], what: &str) -> Result<Option<(Tensor, Vec<Tensor>)>> {
        match self {
            Device::Cpu(_) => Ok(None),
            Device::Cuda(c) => c.remappable(parts, what).map(Some),
        }
    }

    /// Gives the memory of a [`Device::remappable`] reservation back (its tensors keep their
    /// addresses and must not be used until [`Device::remap`]); the bytes given back.
    pub fn unmap(&self, handle: &Tensor) -> Result<usize> {
        match self {
            Device::Cpu(_) => anyhow::bail!("cpu: no tensor is remappable on the CPU"),
            Device::Cuda(c) => c.unmap(handle),
        }
    }

    /// Maps memory into a [`Device::remappable`] reservation again, zero-filled.
    pub fn remap(&self, handle: &Tensor) -> Result<()> {
        match self {
            Device::Cpu(_) => anyhow::bail!("cpu: no tensor is remappable on the CPU"),
            Device::Cuda(c) => c.remap(handle),
        }
    }

    /// Copies a host f32 slice into a new tensor of `dtype` on this device (rounding to nearest
    /// even when `dtype` is BF16/F16).
    pub fn from_f32(&self, dtype: DType, shape: &[usize], data: &[f32]) -> Result<Tensor> {
        let host = Tensor::from_f32_host(dtype, shape, data)?;
        self.upload(host)
    }

    /// Moves a host tensor to this device (no copy on CPU).
    pub fn upload(&self, host: Tensor) -> Result<Tensor> {
        match self {
            Device::Cpu(_) => Ok(host),
            Device::Cuda(c) => c.upload(&host),
        }
    }

    /// Runs `f` inside this device's thread pool (CPU) or directly (CUDA).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match self {
            Device::Cpu(c) => c.install(f),
            Device::Cuda(_) => f(),
        }
    }

    /// [`Device::install`] for a decode loop: the CPU pool's idle threads poll instead of
    /// sleeping until `f` returns (see [`CpuDevice::install_hot`]).
    pub fn install_hot<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match self {
            Device::Cpu(c) => c.install_hot(f),
            Device::Cuda(_) => f(),
        }
    }

    /// Waits for all queued work on this device.
    pub fn synchronize(&self) -> Result<()> {
        match self {
            Device::Cpu(_) => Ok(()),
            Device::Cuda(c) => c.synchronize(),
        }
    }
}
