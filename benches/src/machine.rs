//! Machine summary printed at the top of every report: CPU model, core count, SIMD features, cache and memory sizes,
//! the backend in use.
//!
//! Everything here is best-effort: a field that cannot be read (non-Linux, restricted `/proc`) is reported as
//! `unknown`, never an error. Lines are emitted prefixed by `# ` so a report stays machine-readable (CSV readers skip
//! comment lines).

use std::fmt::Write as _;

/// What the benchmark knows about the machine it runs on.
#[derive(Clone, Debug)]
pub struct Machine {
    /// CPU model string from `/proc/cpuinfo` (`model name`, or `Hardware`/`CPU part` on ARM).
    pub cpu_model: String,
    /// Logical CPUs this process may use (`available_parallelism`).
    pub logical_cpus: usize,
    /// SIMD features detected at run time that the kernels may use.
    pub simd: Vec<&'static str>,
    /// Last-level cache size in bytes, if sysfs reports one.
    pub llc_bytes: Option<u64>,
    /// Total memory in bytes from `/proc/meminfo`.
    pub mem_total: Option<u64>,
    /// Available memory in bytes from `/proc/meminfo`.
    pub mem_available: Option<u64>,
}

impl Machine {
    /// Probes the running machine.
    pub fn detect() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        Machine {
            cpu_model: cpu_model(&cpuinfo).unwrap_or_else(|| "unknown".to_string()),
            logical_cpus: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            simd: simd_features(),
            llc_bytes: llc_bytes(),
            mem_total: meminfo_field(&meminfo, "MemTotal:"),
            mem_available: meminfo_field(&meminfo, "MemAvailable:"),
        }
    }

    /// The summary block, every line starting with `# `. `backend` names the compute backend (`cpu`, `wgpu: ...`),
    /// `threads` the worker threads the run uses.
    pub fn summary(&self, backend: &str, threads: usize) -> String {
        let mut s = String::new();
        let gib = |b: Option<u64>| b.map(|b| format!("{:.1} GiB", b as f64 / GIB)).unwrap_or_else(|| "unknown".into());
        let llc = self.llc_bytes.map(|b| format!("{} MiB", b >> 20)).unwrap_or_else(|| "unknown".into());
        let _ = writeln!(s, "# ds4-bench {}", env!("CARGO_PKG_VERSION"));
        let _ = writeln!(s, "# cpu: {}", self.cpu_model);
        let _ = writeln!(s, "# cores: {} logical, threads used: {threads}", self.logical_cpus);
        let simd = if self.simd.is_empty() { "none".to_string() } else { self.simd.join(" ") };
        let _ = writeln!(s, "# simd: {simd} (CPU quant kernels: {})", ds4_engine::quant::simd::level());
        let _ =
            writeln!(s, "# llc: {llc}, memory: {} total, {} available", gib(self.mem_total), gib(self.mem_available));
        let _ = writeln!(s, "# backend: {backend}");
        s
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// Extracts the CPU model from `/proc/cpuinfo` text.
pub fn cpu_model(cpuinfo: &str) -> Option<String> {
    for key in ["model name", "Hardware", "Processor", "cpu model"] {
        for line in cpuinfo.lines() {
            if let Some((k, v)) = line.split_once(':') {
                if k.trim() == key && !v.trim().is_empty() {
                    return Some(v.trim().to_string());
                }
            }
        }
    }
    None
}

/// Reads a `kB` field of `/proc/meminfo` text, in bytes.
pub fn meminfo_field(meminfo: &str, key: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line[key.len()..].trim().trim_end_matches("kB").trim().parse().ok()?;
    kb.checked_mul(1024)
}

/// Parses a sysfs cache size such as `480M`, `2048K` or `1024`.
pub fn parse_cache_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mul) = match s.chars().last()? {
        'K' | 'k' => (&s[..s.len() - 1], 1u64 << 10),
        'M' | 'm' => (&s[..s.len() - 1], 1 << 20),
        'G' | 'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>().ok()?.checked_mul(mul)
}

/// The largest cache sysfs lists for cpu0 (the last-level cache).
fn llc_bytes() -> Option<u64> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("index"))
        .filter_map(|e| std::fs::read_to_string(e.path().join("size")).ok())
        .filter_map(|s| parse_cache_size(&s))
        .max()
}

/// Run-time detected SIMD features relevant to the quant kernels.
#[allow(unused_mut)]
pub fn simd_features() -> Vec<&'static str> {
    let mut v = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! probe {
            ($($f:tt),*) => { $( if std::arch::is_x86_feature_detected!($f) { v.push($f); } )* };
        }
        probe!(
            "sse4.2",
            "avx",
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512vbmi",
            "avx512vnni",
            "gfni",
            "avxvnni"
        );
    }
    #[cfg(target_arch = "aarch64")]
    {
        macro_rules! probe {
            ($($f:tt),*) => { $( if std::arch::is_aarch64_feature_detected!($f) { v.push($f); } )* };
        }
        probe!("neon", "dotprod", "i8mm", "fp16", "sve");
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_fields() {
        let cpu = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Test CPU @ 2GHz\nflags\t: fpu\n";
        assert_eq!(cpu_model(cpu).as_deref(), Some("Test CPU @ 2GHz"));
        assert_eq!(cpu_model("processor : 0\n"), None);
        let mem = "MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(meminfo_field(mem, "MemTotal:"), Some(24576000 * 1024));
        assert_eq!(meminfo_field(mem, "MemAvailable:"), Some(2048 * 1024));
        assert_eq!(meminfo_field(mem, "SwapTotal:"), None);
    }

    #[test]
    fn parses_cache_sizes() {
        assert_eq!(parse_cache_size("480M\n"), Some(480 << 20));
        assert_eq!(parse_cache_size("48K"), Some(48 << 10));
        assert_eq!(parse_cache_size("1024"), Some(1024));
        assert_eq!(parse_cache_size("x"), None);
        assert_eq!(parse_cache_size(""), None);
    }

    #[test]
    fn summary_lines_are_comments() {
        let m = Machine::detect();
        let s = m.summary("cpu", 2);
        assert!(s.lines().count() >= 5);
        assert!(s.lines().all(|l| l.starts_with("# ")), "{s}");
        assert!(s.contains("backend: cpu"));
    }
}
