//! Build script: the simulated GPU's kernel library in every build (`build_sim`: csrc/kernels
//! compiled for the host, see src/device/cuda/sim.rs), and the CUDA code under `--features cuda`.
//!
//! With the `cuda` feature (CARGO_FEATURE_CUDA) it
//! 1. finds nvcc: `$CUDA_HOME/bin/nvcc`, `$CUDA_PATH/bin/nvcc`, then the pinned toolchain in
//!    `third_party/.toolchain/cuda/bin/nvcc` (bash third_party/install_toolchain.sh), then PATH;
//!    warns unless it reports release 13.0 (see third_party/README.md);
//! 2. compiles every `csrc/kernels/*.cu` into one cubin per architecture of
//!    `COLOTRAIN_CUDA_ARCHS` (default `sm_90a,sm_100a,sm_103a`) and writes
//!    `$OUT_DIR/cuda_kernels.rs`, which embeds them with `include_bytes!` (loaded by
//!    src/device/cuda.rs for the device's compute capability; never PTX JIT);
//! 3. compiles the CUTLASS launchers `csrc/cutlass/gemm_*_sm90.cu` (for sm_90a) and
//!    `gemm_*_sm100.cu` (for sm_100a / sm_103a, one fat object) into the static library
//!    `libcolotrain_cutlass.a`, links it with the toolchain's static cudart, and emits
//!    `cfg(colotrain_cutlass_sm90)` / `cfg(colotrain_cutlass_sm100)` for what was built
//!    (`COLOTRAIN_CUTLASS=0` skips CUTLASS: the low-precision GEMMs then run emulated);
//! 4. checks that src/device/cuda/ffi.rs was generated from the current
//!    csrc/include/colotrain_kernels.h (scripts/gen_bindings.sh records the header's hash).
//!
//! Outputs are cached in OUT_DIR by a hash of (nvcc version, flags, sources, headers): a
//! rebuild recompiles only what changed. `$OUT_DIR/nvcc_times.txt` lists the seconds of every
//! compile; `COLOTRAIN_NVCC_JOBS` caps parallel nvcc jobs (default: cargo's NUM_JOBS).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Instant;

const DEFAULT_ARCHS: &str = "sm_90a,sm_100a,sm_103a";
const CUTLASS_CFGS: [&str; 2] = ["colotrain_cutlass_sm90", "colotrain_cutlass_sm100"];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo::rustc-check-cfg=cfg(colotrain_nvtx)");
    for cfg in CUTLASS_CFGS {
        println!("cargo::rustc-check-cfg=cfg({cfg})");
    }
    if let Err(e) = build_sim() {
        eprintln!("\nerror: the simulated GPU's kernel library failed to build: {e}\n");
        std::process::exit(1);
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    if let Err(e) = build_cuda() {
        eprintln!("\nerror: the CUDA build failed: {e}\n");
        std::process::exit(1);
    }
}

/// The simulated GPU's kernel library, in every build: the kernels of csrc/kernels compiled
/// for the host with the shim of csrc/hostemu (csrc/hostemu/sim.cpp, one C entry point) into
/// `$OUT_DIR/libcolotrain_sim.a`, linked with the C++ runtime. The compiler is `$CXX` (default
/// `c++`); the object is reused while the compiler, flags and sources stay the same.
fn build_sim() -> Res<()> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").map_err(|e| e.to_string())?);
    let out = PathBuf::from(std::env::var("OUT_DIR").map_err(|e| e.to_string())?);
    let csrc = root.join("csrc");
    println!("cargo:rerun-if-changed={}", csrc.join("kernels").display());
    println!("cargo:rerun-if-changed={}", csrc.join("hostemu").display());
    println!("cargo:rerun-if-changed={}", csrc.join("include").display());
    let cxx = env("CXX").unwrap_or_else(|| "c++".into());
    let emu = csrc.join("hostemu");
    let obj = out.join("colotrain_sim.o");
    let lib = out.join("libcolotrain_sim.a");
    let args: Vec<String> = vec![
        "-std=c++17".into(),
        "-O2".into(),
        "-ffp-contract=off".into(),
        "-U_FORTIFY_SOURCE".into(),
        "-fPIC".into(),
        "-include".into(),
        emu.join("shim.h").display().to_string(),
        format!("-I{}", emu.join("include").display()),
        format!("-I{}", csrc.join("include").display()),
        "-c".into(),
        emu.join("sim.cpp").display().to_string(),
        "-o".into(),
        obj.display().to_string(),
    ];
    let dirs = [csrc.join("kernels"), emu.clone(), emu.join("include"), csrc.join("include")];
    let sources = hash_files(&dirs.iter().map(PathBuf::as_path).collect::<Vec<_>>(), &["cu", "cuh", "h", "cpp"])?;
    let stamp = format!("{cxx}|{}|{sources:016x}", args.join(" "));
    let stamp_path = out.join("colotrain_sim.stamp");
    if !(lib.exists() && fs::read_to_string(&stamp_path).map(|s| s == stamp).unwrap_or(false)) {
        let o =
            Command::new(&cxx).args(&args).output().map_err(|e| format!("{cxx}: {e} (a C++17 compiler is needed)"))?;
        if !o.status.success() {
            return Err(format!("{cxx} csrc/hostemu/sim.cpp:\n{}", String::from_utf8_lossy(&o.stderr)));
        }
        let _ = fs::remove_file(&lib);
        let a = Command::new("ar").arg("crs").arg(&lib).arg(&obj).output().map_err(|e| format!("ar: {e}"))?;
        if !a.status.success() {
            return Err(format!("ar: {}", String::from_utf8_lossy(&a.stderr)));
        }
        fs::write(&stamp_path, &stamp).map_err(|e| format!("{}: {e}", stamp_path.display()))?;
    }
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=colotrain_sim");
    println!("cargo:rustc-link-lib=dylib=stdc++");
    Ok(())
}

type Res<T> = Result<T, String>;

struct Job {
    what: String,
    args: Vec<String>,
    output: PathBuf,
    stamp: String,
}

fn env(name: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={name}");
    std::env::var(name).ok().filter(|s| !s.trim().is_empty())
}

fn build_cuda() -> Res<()> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").map_err(|e| e.to_string())?);
    let out = PathBuf::from(std::env::var("OUT_DIR").map_err(|e| e.to_string())?);
    let csrc = root.join("csrc");
    println!("cargo:rerun-if-changed={}", csrc.display());
    println!("cargo:rerun-if-changed={}", root.join("src/device/cuda/ffi.rs").display());
    println!("cargo:rerun-if-changed={}", root.join("third_party/.toolchain/.installed").display());

    check_bindings(&root)?;
    let nvcc = find_nvcc(&root)?;
    let version = run_capture(&nvcc, &["--version"])?;
    if !version.contains("release 13.0") {
        println!(
            "cargo:warning=nvcc at {} is not CUDA 13.0 ({}): cubins from a newer toolkit may not load on a \
             13.0 driver; see third_party/README.md",
            nvcc.display(),
            version.lines().last().unwrap_or("unknown version").trim()
        );
    }
    let cuda_root = nvcc.parent().and_then(Path::parent).map(Path::to_path_buf).ok_or("nvcc has no parent folder")?;
    let archs = parse_archs(&env("COLOTRAIN_CUDA_ARCHS").unwrap_or_else(|| DEFAULT_ARCHS.to_string()))?;
    let cutlass_on = env("COLOTRAIN_CUTLASS").map(|v| v != "0").unwrap_or(true);

    let include = csrc.join("include");
    // Kernels and CUTLASS launchers include different headers: a kernel edit does not
    // invalidate the (slow) CUTLASS objects.
    let kernel_headers = hash_files(&[&include, &csrc.join("kernels")], &["h", "cuh"])?;
    let cutlass_headers = hash_files(&[&include, &csrc.join("cutlass")], &["h", "cuh"])?;
    let mut jobs = Vec::new();

    // 1. Kernel cubins: every csrc/kernels/*.cu, once per architecture.
    let kdir = out.join("kernels");
    fs::create_dir_all(&kdir).map_err(|e| format!("{}: {e}", kdir.display()))?;
    let mut cubins = Vec::new();
    for src in list(&csrc.join("kernels"), "cu")? {
        let stem = stem(&src)?;
        for arch in &archs {
            let output = kdir.join(format!("{stem}.{arch}.cubin"));
            let args = vec![
                "-cubin".into(),
                "-O3".into(),
                "-std=c++17".into(),
                "-lineinfo".into(),
                format!("-arch={arch}"),
                format!("-I{}", include.display()),
                "-o".into(),
                output.display().to_string(),
                src.display().to_string(),
            ];
            let stamp = format!("{version}|{kernel_headers:016x}|{}|{:016x}", args.join(" "), hash_file(&src)?);
            cubins.push((stem.clone(), arch.clone(), output.clone()));
            jobs.push(Job { what: format!("{stem}.cu -> {arch} cubin"), args, output, stamp });
        }
    }

    // 2. CUTLASS launchers: one object per source, with the matching architectures.
    let mut objects = Vec::new();
    let mut cfgs = Vec::new();
    if cutlass_on {
        let (cut_inc, cut_util) = cutlass_includes(&root)?;
        for src in list(&csrc.join("cutlass"), "cu")? {
            let stem = stem(&src)?;
            let (family, cfg): (&[&str], &str) = if stem.ends_with("_sm90") {
                (&["sm_90a"], CUTLASS_CFGS[0])
            } else if stem.ends_with("_sm100") {
                (&["sm_100a", "sm_103a"], CUTLASS_CFGS[1])
            } else {
                return Err(format!("{}: CUTLASS sources must end in _sm90.cu or _sm100.cu", src.display()));
            };
            let targets: Vec<&String> = archs.iter().filter(|a| family.contains(&a.as_str())).collect();
            if targets.is_empty() {
                continue;
            }
            let output = out.join(format!("{stem}.o"));
            let mut args: Vec<String> = vec![
                "-c".into(),
                "-std=c++17".into(),
                "--expt-relaxed-constexpr".into(),
                "-O3".into(),
                "-DNDEBUG".into(),
                "-Xcompiler".into(),
                "-fPIC".into(),
            ];
            for a in &targets {
                let num = a.trim_start_matches("sm_");
                args.push("-gencode".into());
                args.push(format!("arch=compute_{num},code=sm_{num}"));
            }
            args.extend([
                format!("-I{}", include.display()),
                format!("-I{}", cut_inc.display()),
                format!("-I{}", cut_util.display()),
                "-o".into(),
                output.display().to_string(),
                src.display().to_string(),
            ]);
            let stamp = format!("{version}|{cutlass_headers:016x}|{}|{:016x}", args.join(" "), hash_file(&src)?);
            jobs.push(Job {
                what: format!("{stem}.cu -> CUTLASS object for {}", join(&targets)),
                args,
                output: output.clone(),
                stamp,
            });
            objects.push(output);
            if !cfgs.contains(&cfg) {
                cfgs.push(cfg);
            }
        }
    } else {
        println!(
            "cargo:warning=COLOTRAIN_CUTLASS=0: building without the CUTLASS FP8/NVFP4 GEMMs (emulated paths only)"
        );
    }

    // NVTX ranges (host code; the headers come with the pinned nvidia-nvtx wheel).
    let nvtx_h = cuda_root.join("include/nvtx3/nvToolsExt.h");
    if nvtx_h.exists() {
        let src = csrc.join("nvtx/nvtx_ranges.cpp");
        let output = out.join("nvtx_ranges.o");
        let args: Vec<String> = vec![
            "-c".into(),
            "-x".into(),
            "c++".into(),
            "-O2".into(),
            "-Xcompiler".into(),
            "-fPIC".into(),
            "-o".into(),
            output.display().to_string(),
            src.display().to_string(),
        ];
        let stamp = format!("{version}|{:016x}|{}|{:016x}", hash_file(&nvtx_h)?, args.join(" "), hash_file(&src)?);
        jobs.push(Job { what: "nvtx_ranges.cpp -> host object".into(), args, output: output.clone(), stamp });
        objects.push(output);
        cfgs.push("colotrain_nvtx");
    } else {
        println!("cargo:warning={} not found: building without NVTX ranges (install the pinned toolchain, third_party/install_toolchain.sh)", nvtx_h.display());
    }

    // CUTLASS objects first: they take minutes each.
    jobs.sort_by_key(|j| !j.what.contains("CUTLASS"));
    run_jobs(&nvcc, jobs, &out)?;

    if !objects.is_empty() {
        let lib = out.join("libcolotrain_cutlass.a");
        let _ = fs::remove_file(&lib);
        let ar = std::env::var("AR").unwrap_or_else(|_| "ar".into());
        let mut args = vec!["crs".to_string(), lib.display().to_string()];
        args.extend(objects.iter().map(|o| o.display().to_string()));
        let st = Command::new(&ar).args(&args).status().map_err(|e| format!("cannot run {ar}: {e}"))?;
        if !st.success() {
            return Err(format!("{ar} {} failed", args.join(" ")));
        }
        println!("cargo:rustc-link-search=native={}", out.display());
        println!("cargo:rustc-link-lib=static=colotrain_cutlass");
        for dir in ["lib64", "lib"] {
            let d = cuda_root.join(dir);
            if d.join("libcudart_static.a").exists() {
                println!("cargo:rustc-link-search=native={}", d.display());
                break;
            }
        }
        println!("cargo:rustc-link-lib=static=cudart_static");
        for l in ["stdc++", "dl", "rt", "pthread"] {
            println!("cargo:rustc-link-lib=dylib={l}");
        }
        for cfg in &cfgs {
            println!("cargo:rustc-cfg={cfg}");
        }
    }
    write_kernels_rs(&out, &archs, &cubins)
}

fn parse_archs(s: &str) -> Res<Vec<String>> {
    let mut v: Vec<String> = Vec::new();
    for a in s.split(|c: char| c == ',' || c.is_whitespace()).filter(|a| !a.is_empty()) {
        let num =
            a.strip_prefix("sm_").ok_or_else(|| format!("COLOTRAIN_CUDA_ARCHS: '{a}' is not of the form sm_90a"))?;
        let digits = num.trim_end_matches(['a', 'f']);
        if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit()) || num.len() > digits.len() + 1 {
            return Err(format!("COLOTRAIN_CUDA_ARCHS: '{a}' is not of the form sm_90a, sm_100a, sm_89"));
        }
        if !v.iter().any(|x| x == a) {
            v.push(a.to_string());
        }
    }
    if v.is_empty() {
        return Err("COLOTRAIN_CUDA_ARCHS is empty".into());
    }
    Ok(v)
}

fn find_nvcc(root: &Path) -> Res<PathBuf> {
    let mut tried = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(h) = env(var) {
            let p = PathBuf::from(h).join("bin/nvcc");
            if p.is_file() {
                return Ok(p);
            }
            tried.push(p);
        }
    }
    let pinned = root.join("third_party/.toolchain/cuda/bin/nvcc");
    if pinned.is_file() {
        return Ok(pinned);
    }
    tried.push(pinned);
    if let Some(path) = std::env::var_os("PATH") {
        for d in std::env::split_paths(&path) {
            let p = d.join("nvcc");
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    Err(format!(
        "no nvcc found (tried {} and PATH). Install the pinned toolchain with \
         `bash third_party/install_toolchain.sh` (no GPU needed), or set CUDA_HOME",
        tried.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    ))
}

fn cutlass_includes(root: &Path) -> Res<(PathBuf, PathBuf)> {
    let inc = env("CUTLASS_INCLUDE")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("third_party/.toolchain/cutlass-include"));
    let util = env("CUTLASS_UTIL_INCLUDE")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("third_party/.toolchain/cutlass-util-include"));
    if !inc.join("cutlass/cutlass.h").is_file() || !util.join("cutlass/util/packed_stride.hpp").is_file() {
        return Err(format!(
            "CUTLASS headers not found in {} and {}: run `bash third_party/install_toolchain.sh`, set \
             CUTLASS_INCLUDE / CUTLASS_UTIL_INCLUDE, or build without CUTLASS with COLOTRAIN_CUTLASS=0",
            inc.display(),
            util.display()
        ));
    }
    Ok((inc, util))
}

/// Runs the compile jobs whose stamp changed, `jobs` at a time, and records their durations.
fn run_jobs(nvcc: &Path, jobs: Vec<Job>, out: &Path) -> Res<()> {
    let todo: Vec<Job> = jobs
        .into_iter()
        .filter(|j| {
            let stamp = j.output.with_extension("stamp");
            !(j.output.is_file() && fs::read_to_string(&stamp).map(|s| s == j.stamp).unwrap_or(false))
        })
        .collect();
    let limit = std::env::var("COLOTRAIN_NVCC_JOBS")
        .ok()
        .or_else(|| std::env::var("NUM_JOBS").ok())
        .and_then(|s| s.parse::<usize>().ok())
        .unwrap_or(2)
        .max(1);
    println!("cargo:rerun-if-env-changed=COLOTRAIN_NVCC_JOBS");
    let queue = Arc::new(Mutex::new(todo.into_iter().collect::<std::collections::VecDeque<Job>>()));
    let results = Arc::new(Mutex::new(Vec::<(String, f64, Option<String>)>::new()));
    let started = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..limit {
            let (queue, results) = (queue.clone(), results.clone());
            s.spawn(move || loop {
                let job = match queue.lock().map(|mut q| q.pop_front()) {
                    Ok(Some(j)) => j,
                    _ => break,
                };
                let t = Instant::now();
                let res = Command::new(nvcc).args(&job.args).output();
                let secs = t.elapsed().as_secs_f64();
                let err = match res {
                    Ok(o) if o.status.success() => {
                        let _ = fs::write(job.output.with_extension("stamp"), &job.stamp);
                        None
                    }
                    Ok(o) => Some(format!(
                        "{} failed:\n{} {}\n{}{}",
                        job.what,
                        nvcc.display(),
                        job.args.join(" "),
                        String::from_utf8_lossy(&o.stdout),
                        String::from_utf8_lossy(&o.stderr)
                    )),
                    Err(e) => Some(format!("cannot run {}: {e}", nvcc.display())),
                };
                if let Ok(mut r) = results.lock() {
                    r.push((job.what, secs, err));
                }
            });
        }
    });
    let results = results.lock().map_err(|_| "a compile thread panicked".to_string())?;
    let mut report = String::new();
    for (what, secs, _) in results.iter() {
        report.push_str(&format!("{secs:8.1} s  {what}\n"));
    }
    report.push_str(&format!("{:8.1} s  total wall time ({limit} parallel jobs)\n", started.elapsed().as_secs_f64()));
    let _ = fs::write(out.join("nvcc_times.txt"), report);
    match results.iter().find_map(|r| r.2.clone()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn write_kernels_rs(out: &Path, archs: &[String], cubins: &[(String, String, PathBuf)]) -> Res<()> {
    let mut s = String::from("// Generated by build.rs: the kernel cubins, one per (module, architecture).\n");
    s.push_str(&format!("pub const BUILT_ARCHS: &[&str] = &{archs:?};\n"));
    s.push_str("pub static CUBINS: &[Cubin] = &[\n");
    for (module, arch, path) in cubins {
        s.push_str(&format!(
            "    Cubin {{ module: {module:?}, arch: {arch:?}, bytes: include_bytes!({:?}) }},\n",
            path.display().to_string()
        ));
    }
    s.push_str("];\n");
    let path = out.join("cuda_kernels.rs");
    fs::write(&path, s).map_err(|e| format!("{}: {e}", path.display()))
}

/// The bindings must come from the current header: ffi.rs records the header's FNV-1a hash.
fn check_bindings(root: &Path) -> Res<()> {
    let header = root.join("csrc/include/colotrain_kernels.h");
    let ffi = root.join("src/device/cuda/ffi.rs");
    let want = format!("{:016x}", fnv1a(&fs::read(&header).map_err(|e| format!("{}: {e}", header.display()))?));
    let text = fs::read_to_string(&ffi).map_err(|e| format!("{}: {e}", ffi.display()))?;
    let got = text.lines().find_map(|l| l.strip_prefix("// header-fnv1a64: ")).map(str::trim);
    if got != Some(want.as_str()) {
        return Err(format!(
            "{} does not match {} (recorded hash {}, header hash {want}): regenerate the bindings with \
             scripts/gen_bindings.sh",
            ffi.display(),
            header.display(),
            got.unwrap_or("missing")
        ));
    }
    Ok(())
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn hash_file(p: &Path) -> Res<u64> {
    Ok(fnv1a(&fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?))
}

fn hash_files(dirs: &[&Path], exts: &[&str]) -> Res<u64> {
    let mut h = Vec::new();
    for d in dirs {
        for ext in exts {
            for f in list(d, ext)? {
                h.extend_from_slice(f.display().to_string().as_bytes());
                h.extend_from_slice(&hash_file(&f)?.to_le_bytes());
            }
        }
    }
    Ok(fnv1a(&h))
}

/// Files of `dir` ending in `.ext`, sorted.
fn list(dir: &Path, ext: &str) -> Res<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().and_then(|x| x.to_str()) == Some(ext))
        .collect();
    v.sort();
    Ok(v)
}

fn stem(p: &Path) -> Res<String> {
    p.file_stem().and_then(|s| s.to_str()).map(str::to_string).ok_or_else(|| format!("bad file name {}", p.display()))
}

fn join(v: &[&String]) -> String {
    v.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
}

fn run_capture(cmd: &Path, args: &[&str]) -> Res<String> {
    let o = Command::new(cmd).args(args).output().map_err(|e| format!("cannot run {}: {e}", cmd.display()))?;
    if !o.status.success() {
        return Err(format!("{} {} failed: {}", cmd.display(), args.join(" "), String::from_utf8_lossy(&o.stderr)));
    }
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}
