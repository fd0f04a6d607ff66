//! A reward plug-in: the user's `[reward] command`, started once per run as ONE persistent
//! subprocess. Each item goes to its stdin as one JSON line (`{"response", "answer", "prompt",
//! "meta"}`, absent fields left out); it answers one line per item, in order, on stdout:
//! `{"reward": <number>, ...}` (its other numeric fields are kept, other fields ignored). A
//! plug-in must flush stdout after each answer (Python: `print(..., flush=True)`).
//!
//! Owns: the subprocess (start, restarts, end), its three pipes and the protocol. May call: std
//! and serde_json. Must not: buffer without bound (answers pass through a channel of `batch`
//! lines, a line over [`MAX_LINE`] bytes is an error, stderr keeps its last [`STDERR_LINES`]
//! lines), block past a batch's deadline (stdin is written by its own thread), panic or log on
//! anything the plug-in does (the caller logs [`Plugin::restarts`]), or leave threads running
//! after Drop: the pipe threads end with the process and are joined; one whose pipe a grandchild
//! of the plug-in still holds open is detached, and ends when that pipe closes.

use anyhow::{anyhow, bail, Result};
use serde::Serialize;
use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// The longest answer line accepted, in bytes (a longer one is an error, never buffered whole).
pub const MAX_LINE: usize = 1 << 20;
/// How many of the plug-in's last stderr lines are kept to quote in errors.
pub const STDERR_LINES: usize = 20;
/// Restarts allowed over a plug-in's life (and at most one per batch).
pub const MAX_RESTARTS: usize = 3;

/// How to run a plug-in (the run config's `[reward]` table).
#[derive(Clone, Debug)]
pub struct PluginConfig {
    /// Program and arguments.
    pub command: Vec<String>,
    /// Seconds the plug-in may take to answer one batch.
    pub timeout_s: f64,
    /// The most items sent in one batch (also the bound on answers waiting to be read).
    pub batch: usize,
}

/// One response to score, sent as one JSON line (`None` fields left out).
#[derive(Clone, Debug, Serialize)]
pub struct Item {
    /// The model's response.
    pub response: String,
    /// The prompt's reference answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    /// The prompt's text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// The dataset line's `meta` field, as it is (e.g. a code task's tests).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub meta: Option<serde_json::Value>,
}

/// The plug-in's answer to one item.
#[derive(Clone, Debug, PartialEq)]
pub struct Scored {
    /// The answer's `reward` (finite).
    pub reward: f32,
    /// The answer's other numeric fields.
    pub extra: BTreeMap<String, f64>,
}

/// A running plug-in. Scoring failures (a crash, a timeout, a malformed or overlong answer
/// line) kill the process, start it again and retry the same batch once; a batch that fails
/// again, or any failure once [`MAX_RESTARTS`] restarts have been used over the plug-in's life,
/// is an error. Dropping it closes the plug-in's stdin, waits up to 1 s for it to exit, then
/// kills it.
pub struct Plugin {
    cfg: PluginConfig,
    label: String,
    timeout: Duration,
    proc: Option<Proc>,
    restarts: usize,
}

impl Plugin {
    /// Checks `cfg` and starts the command: an empty command, a program that cannot be
    /// started, a zero batch or a timeout that is not a positive number is an error.
    pub fn start(cfg: &PluginConfig) -> Result<Plugin> {
        if cfg.command.is_empty() {
            bail!("reward plug-in: the command is empty");
        }
        let label = cfg.command.join(" ");
        if cfg.batch == 0 {
            bail!("reward plug-in `{label}`: batch must be at least 1");
        }
        let timeout =
            Some(cfg.timeout_s).filter(|t| *t > 0.0).and_then(|t| Duration::try_from_secs_f64(t.min(1e9)).ok());
        let timeout = timeout
            .ok_or_else(|| anyhow!("reward plug-in `{label}`: timeout_s must be positive, not {}", cfg.timeout_s))?;
        let proc = Proc::spawn(&cfg.command, cfg.batch).map_err(|e| anyhow!("reward plug-in `{label}`: {}", e.msg))?;
        Ok(Plugin { cfg: cfg.clone(), label, timeout, proc: Some(proc), restarts: 0 })
    }

    /// Scores items in batches of at most `batch`; returns one [`Scored`] per item, in order.
    pub fn score(&mut self, items: &[Item]) -> Result<Vec<Scored>> {
        let mut out = Vec::with_capacity(items.len());
        for chunk in items.chunks(self.cfg.batch) {
            out.extend(self.score_batch(chunk)?);
        }
        Ok(out)
    }

    /// How many times the plug-in has been restarted.
    pub fn restarts(&self) -> usize {
        self.restarts
    }

    fn score_batch(&mut self, items: &[Item]) -> Result<Vec<Scored>> {
        // Whether this batch restarted the plug-in, and the failure that called for it.
        let (mut restarted, mut prev) = (false, None::<Fail>);
        loop {
            let proc = match &mut self.proc {
                Some(p) => p,
                None if self.restarts >= MAX_RESTARTS => {
                    bail!(
                        "reward plug-in `{}`: stopped after an earlier error ({MAX_RESTARTS} restarts used)",
                        self.label
                    )
                }
                None => {
                    (self.restarts, restarted) = (self.restarts + 1, true);
                    let p = Proc::spawn(&self.cfg.command, self.cfg.batch).map_err(|e| {
                        let (msg, tail) = prev.take().map_or_else(Default::default, |f| (f.msg + "; ", f.tail));
                        anyhow!("reward plug-in `{}`: {msg}on restart, {}{tail}", self.label, e.msg)
                    })?;
                    self.proc.insert(p)
                }
            };
            match proc.batch(items, self.timeout, self.cfg.timeout_s) {
                Ok(scored) => return Ok(scored),
                Err(Fail { msg, tail }) => {
                    if let Some(p) = self.proc.take() {
                        p.stop(Duration::ZERO);
                    }
                    let note = match (restarted, self.restarts >= MAX_RESTARTS) {
                        (true, _) => " (again after a restart)",
                        (false, true) => " (no restart left)",
                        (false, false) => {
                            prev = Some(Fail { msg, tail });
                            continue;
                        }
                    };
                    bail!("reward plug-in `{}`: {msg}{note}{tail}", self.label);
                }
            }
        }
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        if let Some(p) = self.proc.take() {
            p.stop(Duration::from_secs(1));
        }
    }
}

/// Why a batch failed, and the plug-in's last stderr lines (empty, or "; its last stderr...").
struct Fail {
    msg: String,
    tail: String,
}

/// What the stdout thread passes on: a line, a line over [`MAX_LINE`] bytes, or EOF.
enum Msg {
    Line(String),
    TooLong,
    Closed,
}

/// One started process and its pipe threads: [stdout reader, stderr reader, stdin writer].
struct Proc {
    child: Child,
    stdin: SyncSender<Vec<u8>>,
    stdout: Receiver<Msg>,
    stderr: Arc<Mutex<VecDeque<String>>>,
    threads: Vec<JoinHandle<()>>,
}

impl Proc {
    fn spawn(command: &[String], batch: usize) -> Result<Proc, Fail> {
        let fail = |msg: String| Fail { msg, tail: String::new() };
        let (prog, args) = command.split_first().ok_or_else(|| fail("the command is empty".into()))?;
        let mut cmd = Command::new(prog);
        cmd.args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().map_err(|e| fail(format!("could not start: {e}")))?;
        let (Some(mut inp), Some(out), Some(err)) = (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            let _ = (child.kill(), child.wait());
            return Err(fail("could not open its pipes".into()));
        };
        let ((ltx, stdout), (stdin, wrx)) = (sync_channel(batch), sync_channel::<Vec<u8>>(1));
        let stderr = Arc::new(Mutex::new(VecDeque::new()));
        let ring = Arc::clone(&stderr);
        let jobs: [Box<dyn FnOnce() + Send>; 3] = [
            Box::new(move || read_answers(out, ltx)),
            Box::new(move || keep_tail(err, ring)),
            Box::new(move || {
                let _ = wrx.iter().try_for_each(|buf| inp.write_all(&buf).and_then(|()| inp.flush()));
            }),
        ];
        let threads = jobs.into_iter().map(|job| thread::Builder::new().name("reward-plugin".into()).spawn(job));
        match threads.collect::<std::io::Result<Vec<_>>>() {
            Ok(threads) => Ok(Proc { child, stdin, stdout, stderr, threads }),
            Err(e) => {
                let _ = (child.kill(), child.wait()); // threads already started end with its pipes
                Err(fail(format!("could not start a thread: {e}")))
            }
        }
    }

    /// Sends `items` and reads one answer each before the deadline.
    fn batch(&mut self, items: &[Item], timeout: Duration, timeout_s: f64) -> Result<Vec<Scored>, Fail> {
        let (n, mut out, mut buf) = (items.len(), Vec::with_capacity(items.len()), Vec::new());
        match self.stdout.try_recv() {
            Err(TryRecvError::Empty) => {}
            Ok(Msg::Line(l)) => {
                return Err(self.fail(format!("printed a line that answers nothing: {}", clip(&l, 200))))
            }
            Ok(Msg::TooLong) => return Err(self.fail("printed a line that answers nothing".into())),
            Ok(Msg::Closed) | Err(TryRecvError::Disconnected) => return Err(self.exited(0, n)),
        }
        for it in items {
            serde_json::to_writer(&mut buf, it).map_err(|e| self.fail(format!("could not encode an item: {e}")))?;
            buf.push(b'\n');
        }
        // Disconnected: the writer met a closed stdin; the reads below say why.
        if let Err(TrySendError::Full(_)) = self.stdin.try_send(buf) {
            return Err(self.fail("is not reading its input".into()));
        }
        let deadline = Instant::now().checked_add(timeout);
        while out.len() < n {
            let k = out.len() + 1;
            let left = deadline.map_or(timeout, |d| d.saturating_duration_since(Instant::now()));
            let msg = match self.stdout.recv_timeout(left) {
                Ok(Msg::Line(line)) => match parse(&line) {
                    Ok(s) => {
                        out.push(s);
                        continue;
                    }
                    Err(why) => format!("answer line {k} of the batch {why}: {}", clip(&line, 200)),
                },
                Ok(Msg::TooLong) => format!("answer line {k} of the batch is over {MAX_LINE} bytes"),
                Ok(Msg::Closed) | Err(RecvTimeoutError::Disconnected) => return Err(self.exited(k - 1, n)),
                Err(RecvTimeoutError::Timeout) => {
                    format!("no answer within {timeout_s} s for a batch of {n} (timeout; {} answered)", k - 1)
                }
            };
            return Err(self.fail(msg));
        }
        Ok(out)
    }

    /// `msg` with the last stderr lines.
    fn fail(&self, msg: String) -> Fail {
        let q = self.stderr.lock().unwrap_or_else(|e| e.into_inner());
        let lines: Vec<&str> = q.iter().rev().map(String::as_str).collect();
        let tail = if lines.is_empty() {
            String::new()
        } else {
            format!("; its last stderr lines:\n  {}", lines.join("\n  "))
        };
        Fail { msg, tail }
    }

    /// The failure of a process whose stdout closed after `k` of `n` answers.
    fn exited(&mut self, k: usize, n: usize) -> Fail {
        let status = wait_until(Duration::from_secs(1), || !matches!(self.child.try_wait(), Ok(None)));
        let status = if status { self.child.try_wait().ok().flatten() } else { None };
        // Let the stderr thread read what the process wrote last.
        wait_until(Duration::from_millis(500), || self.threads.get(1).is_none_or(|t| t.is_finished()));
        let how = match status.map(|s| (s.code(), s)) {
            Some((Some(c), _)) => format!("exited with status {c}"),
            Some((None, s)) => format!("was ended ({s})"),
            None => "closed its stdout".into(),
        };
        self.fail(match k {
            0 => format!("{how} before answering a batch of {n}"),
            _ => format!("{how} after answer line {k} of {n}"),
        })
    }

    /// Closes stdin, waits up to `grace` for the process to exit, kills it, and joins the pipe
    /// threads that end within 200 ms (the others are detached).
    fn stop(self, grace: Duration) {
        let Proc { mut child, stdin, stdout, stderr: _, threads } = self;
        drop((stdin, stdout)); // the writer ends (closing stdin); a reader blocked on a full channel ends
        wait_until(grace, || !matches!(child.try_wait(), Ok(None)));
        let _ = (child.kill(), child.wait());
        wait_until(Duration::from_millis(200), || threads.iter().all(|t| t.is_finished()));
        for t in threads.into_iter().filter(|t| t.is_finished()) {
            let _ = t.join();
        }
    }
}

/// Polls `done` every 5 ms for up to `limit`; returns its last value.
fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while !done() {
        if start.elapsed() >= limit {
            return false;
        }
        thread::sleep(Duration::from_millis(5));
    }
    true
}

/// Reads stdout lines into `tx` (bounded) until EOF, an overlong line or a dropped receiver.
fn read_answers(out: impl Read, tx: SyncSender<Msg>) {
    let mut r = BufReader::new(out);
    loop {
        let mut buf = Vec::new();
        let msg = match (&mut r).take(MAX_LINE as u64 + 1).read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => Msg::Closed,
            Ok(_) if buf.len() > MAX_LINE && buf.last() != Some(&b'\n') => Msg::TooLong,
            Ok(_) => Msg::Line(String::from_utf8_lossy(&buf).trim_end_matches(['\n', '\r']).into()),
        };
        let more = matches!(msg, Msg::Line(_));
        if tx.send(msg).is_err() || !more {
            return;
        }
    }
}

/// Keeps the last [`STDERR_LINES`] lines of stderr (each cut to 300 chars) until EOF.
fn keep_tail(err: impl Read, ring: Arc<Mutex<VecDeque<String>>>) {
    let mut r = BufReader::new(err);
    let mut buf = Vec::new();
    while let Ok(1..) = (&mut r).take(4096).read_until(b'\n', &mut buf) {
        let mut q = ring.lock().unwrap_or_else(|e| e.into_inner());
        q.truncate(STDERR_LINES - 1);
        q.push_front(clip(String::from_utf8_lossy(&buf).trim_end(), 300)); // newest first
        buf.clear();
    }
}

/// An answer line's reward and other numeric fields.
fn parse(line: &str) -> Result<Scored, &'static str> {
    let bad = "is not JSON with a numeric \"reward\"";
    let v: serde_json::Value = serde_json::from_str(line).map_err(|_| bad)?;
    let obj = v.as_object().ok_or(bad)?;
    let reward = obj.get("reward").and_then(|r| r.as_f64()).ok_or(bad)? as f32;
    if !reward.is_finite() {
        return Err("has a reward that is not a finite 32-bit number");
    }
    let extra =
        obj.iter().filter(|(k, _)| *k != "reward").filter_map(|(k, v)| Some((k.clone(), v.as_f64()?))).collect();
    Ok(Scored { reward, extra })
}

/// `s` cut to `n` chars (marked with "…" when cut).
fn clip(s: &str, n: usize) -> String {
    match s.char_indices().nth(n) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A scratch folder (removed on drop) holding one Python plug-in script.
    struct Dir(std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    /// A config running `body` (after `import json, os, sys, time`) with python3, in a new folder.
    fn script(body: &str, timeout_s: f64, batch: usize) -> (Dir, PluginConfig) {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let d = Dir(std::env::temp_dir().join(format!("colotrain-plugin-{}-{n}", std::process::id())));
        std::fs::create_dir_all(&d.0).unwrap();
        let p = d.0.join("plugin.py");
        std::fs::write(&p, format!("import json, os, sys, time\n{body}")).unwrap();
        (d, PluginConfig { command: vec!["python3".into(), p.display().to_string()], timeout_s, batch })
    }
    fn items(n: usize) -> Vec<Item> {
        let it = |i: usize| Item {
            response: "x".repeat(i),
            answer: (i % 2 == 0).then(|| i.to_string()),
            prompt: None,
            meta: Some(serde_json::json!({ "i": i })),
        };
        (0..n).map(it).collect()
    }
    const GOOD: &str = "for line in sys.stdin:
    d = json.loads(line)
    r = {'reward': len(d['response']) % 3, 'i': d['meta']['i'], 'answer': int('answer' in d), 'prompt': 'prompt' in d}
    print(json.dumps(r), flush=True)
";
    fn err(cfg: &PluginConfig, n: usize) -> String {
        format!("{:#}", Plugin::start(cfg).unwrap().score(&items(n)).unwrap_err())
    }

    #[test]
    fn scores_every_item_in_order_across_batches() {
        let (_d, cfg) = script(GOOD, 5.0, 8);
        let mut p = Plugin::start(&cfg).unwrap();
        let got = p.score(&items(25)).unwrap();
        assert_eq!(got.len(), 25);
        for (i, s) in got.iter().enumerate() {
            assert_eq!(s.reward, (i % 3) as f32, "item {i}");
            // "answer": whether the item had one (None is left out); the bool "prompt" is not numeric.
            let extra = BTreeMap::from([("answer".into(), (i % 2 == 0) as u8 as f64), ("i".into(), i as f64)]);
            assert_eq!(s.extra, extra, "item {i}");
        }
        assert_eq!(p.score(&[]).unwrap(), vec![]);
        assert_eq!(p.restarts(), 0);
    }

    #[test]
    fn a_malformed_answer_names_the_command_and_the_line() {
        let (_d, cfg) = script("for line in sys.stdin:\n    print('oops, not json', flush=True)\n", 5.0, 4);
        let mut p = Plugin::start(&cfg).unwrap();
        let e = format!("{:#}", p.score(&items(3)).unwrap_err());
        let want = "answer line 1 of the batch is not JSON with a numeric \"reward\": oops, not json";
        assert!(e.starts_with(&format!("reward plug-in `{}`: {want}", cfg.command.join(" "))), "{e}");
        assert_eq!(p.restarts(), 1, "retried once");
        let (_d, cfg) = script("for line in sys.stdin:\n    print('{\"reward\": 1e39}', flush=True)\n", 5.0, 4);
        assert!(err(&cfg, 1).contains("has a reward that is not a finite"));
        let long = "for line in sys.stdin:\n    print('{\"reward\": 1, \"pad\": \"' + 'x' * (2 << 20) + '\"}')\n";
        assert!(
            err(&script(long, 5.0, 2).1, 1).contains(&format!("answer line 1 of the batch is over {MAX_LINE} bytes"))
        );
    }

    #[test]
    fn a_slow_plugin_times_out() {
        let (_d, cfg) = script("for line in sys.stdin:\n    time.sleep(30)\n", 0.3, 4);
        let mut p = Plugin::start(&cfg).unwrap();
        let t = Instant::now();
        let e = format!("{:#}", p.score(&items(2)).unwrap_err());
        // Two tries of 0.3 s: the first, and one after a restart.
        assert!(t.elapsed() < Duration::from_secs_f64(2.0 * 0.3 + 1.5), "{:?}", t.elapsed());
        assert!(e.contains("no answer within 0.3 s for a batch of 2 (timeout"), "{e}");
        assert_eq!(p.restarts(), 1);
    }

    #[test]
    fn a_crash_on_the_first_batch_is_retried_once() {
        let body = "if not os.path.exists('crashed'):\n    open('crashed', 'w').close()\n    sys.stdin.readline()\n    sys.exit(1)\n";
        let (_d, cfg) = script(&format!("os.chdir(os.path.dirname(sys.argv[0]))\n{body}{GOOD}"), 5.0, 8);
        let mut p = Plugin::start(&cfg).unwrap();
        let got: Vec<f32> = p.score(&items(10)).unwrap().iter().map(|s| s.reward).collect();
        assert_eq!(got, (0..10).map(|i| (i % 3) as f32).collect::<Vec<_>>());
        assert_eq!(p.restarts(), 1);
    }

    #[test]
    fn a_plugin_that_always_crashes_is_an_error_quoting_its_stderr() {
        let body = "sys.stdin.readline()\nprint('{\"reward\": 1}', flush=True)\nsys.exit('boom: bad config')\n";
        let (_d, cfg) = script(body, 5.0, 4);
        let mut p = Plugin::start(&cfg).unwrap();
        let e = format!("{:#}", p.score(&items(4)).unwrap_err());
        assert!(e.contains("exited with status 1 after answer line 1 of 4 (again after a restart)"), "{e}");
        assert!(e.ends_with("its last stderr lines:\n  boom: bad config"), "{e}");
        // Three restarts over the plug-in's life, then errors are final.
        assert!(p.score(&items(2)).is_err() && p.score(&items(2)).is_err());
        assert_eq!(p.restarts(), MAX_RESTARTS);
        assert!(format!("{:#}", p.score(&items(1)).unwrap_err()).contains("stopped after an earlier error"));
    }

    #[test]
    fn bad_commands_are_clear_errors() {
        let start = |command: &[&str], timeout_s: f64| {
            let command = command.iter().map(|s| s.to_string()).collect();
            Plugin::start(&PluginConfig { command, timeout_s, batch: 4 }).err().unwrap().to_string()
        };
        let e = start(&["/nonexistent/reward-plugin", "--x"], 1.0);
        assert!(e.starts_with("reward plug-in `/nonexistent/reward-plugin --x`: could not start: No such file"), "{e}");
        assert!(start(&[], 1.0).contains("the command is empty"));
        assert!(start(&["python3"], f64::NAN).contains("timeout_s must be positive"));
    }
}
