//! A closed-loop load generator for an OpenAI-compatible `/v1/chat/completions` endpoint:
//! N clients each send greedy chat completions one after another, and every answer is
//! compared with the answer its prompt gets when sent alone.
//!
//! mistral.rs's batched serving is not batch-invariant: a sequence's float sums can depend on
//! the requests served with it (its dense MLP server does it too), and every layer re-quantizes
//! its input to 8 bits, which turns a last-bit difference into a visible one now and then, so a
//! greedy answer can part from its solo answer where the solo run's best tokens nearly tie. An answer that parts only
//! there counts as a tie, not as wrong: the solo requests ask for the top candidates' scores
//! (mistral.rs's greedy sampler reports `log10(logit)` as `logprob`), and an answer is a tie
//! when it follows the solo answer token for token up to a step where it takes a candidate
//! whose logit is within [`TIE`] of the chosen one. Any other difference is wrong (another
//! request's answer, as unpatched mistral.rs gives, parts at the second token by whole logits).
//!
//! Written here rather than taken from crates.io: load generators such as `oha` send one body
//! over and over and look only at status codes and timings, and this test is about different
//! prompts in one batch and whether each answer is its own.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result};

/// Sixteen different one-line requests, one per client at the largest level.
pub const PROMPTS: [&str; 16] = [
    "Write one sentence about a baker.",
    "Write one sentence about a sailor.",
    "Name three colors of the rainbow.",
    "What is the capital of France?",
    "Write about the number 1.",
    "Write about the number 4.",
    "Give one tip for learning to swim.",
    "Describe a cat in one sentence.",
    "What is two plus two?",
    "Write a haiku about rain.",
    "Why is the sky blue?",
    "Name a planet in our solar system.",
    "Write one sentence about a teacher.",
    "What do bees make?",
    "Describe a mountain in one sentence.",
    "Say hello in Spanish.",
];

fn request(prompt: &str, tokens: u32, logprobs: bool) -> serde_json::Value {
    let mut body = serde_json::json!({
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0.0,
    });
    if logprobs {
        body["logprobs"] = true.into();
        body["top_logprobs"] = 5.into();
    }
    body
}

async fn post(
    client: &reqwest::Client,
    base: &str,
    body: &serde_json::Value,
) -> Result<serde_json::Value> {
    let resp = client
        .post(format!("{base}/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .context("POST /v1/chat/completions")?;
    let status = resp.status();
    let text = resp.text().await?;
    anyhow::ensure!(status.is_success(), "HTTP {status}: {text}");
    serde_json::from_str(&text).with_context(|| format!("response is not JSON: {text}"))
}

/// One greedy chat completion over HTTP: its text and how many tokens it has.
pub async fn ask(
    client: &reqwest::Client,
    base: &str,
    prompt: &str,
    tokens: u32,
) -> Result<(String, u64)> {
    let json = post(client, base, &request(prompt, tokens, false)).await?;
    let answer = json["choices"][0]["message"]["content"]
        .as_str()
        .with_context(|| format!("no choices[0].message.content in {json}"))?;
    let tokens = json["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    Ok((answer.to_string(), tokens))
}

/// Largest logit gap (nats) between the solo answer's token and the one an answer under load
/// took instead, for the difference to count as a tie. Measured on SmolLM2 through mistral.rs's
/// dense MLP (no sparse FFN): batched answers parted from their solo answers after 8 to 29
/// equal tokens at gaps up to 0.10, the batch's float differences grown through the Q8_1
/// re-quantization of every layer's input; the request mix-up that the patch set fixes parts
/// at the second token.
pub const TIE: f64 = 0.25;

/// A prompt's answer sent alone, with the top candidates of every step.
#[derive(Debug, Clone)]
pub struct Reference {
    pub text: String,
    /// Per generated token: the chosen piece, and the top candidates (piece, logit), best first.
    steps: Vec<(String, Vec<(String, f64)>)>,
}

/// How an answer under load compares with its [`Reference`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    Same,
    /// Equal for `tokens` tokens, then another candidate within `gap` logits of the chosen one.
    Tie {
        tokens: usize,
        gap: f64,
    },
    /// Equal for `tokens` tokens, then a token that was no near-tie: `gap` logits below the
    /// chosen one when it was among the solo run's top candidates.
    Wrong {
        tokens: usize,
        gap: Option<f64>,
    },
}

impl Reference {
    /// Parses a `/v1/chat/completions` response asked with `logprobs` and `top_logprobs`.
    fn parse(json: &serde_json::Value) -> Result<Reference> {
        let text = json["choices"][0]["message"]["content"]
            .as_str()
            .context("no choices[0].message.content")?
            .to_string();
        let content = json["choices"][0]["logprobs"]["content"]
            .as_array()
            .context("no choices[0].logprobs.content")?;
        let mut steps = Vec::with_capacity(content.len());
        for step in content {
            let piece = step["token"]
                .as_str()
                .context("logprobs token")?
                .to_string();
            let top = step["top_logprobs"]
                .as_array()
                .context("top_logprobs")?
                .iter()
                .filter_map(|c| {
                    // mistral.rs puts the piece in `bytes` and the id in `token` here.
                    let piece = c["bytes"].as_str()?.to_string();
                    Some((piece, 10f64.powf(c["logprob"].as_f64()?)))
                })
                .collect();
            steps.push((piece, top));
        }
        Ok(Reference { text, steps })
    }

    /// Judges `got`, an answer to the same prompt under load.
    pub fn judge(&self, got: &str) -> Verdict {
        if got == self.text {
            return Verdict::Same;
        }
        let mut prefix = String::new();
        for (i, (piece, top)) in self.steps.iter().enumerate() {
            let next = format!("{prefix}{piece}");
            if got.starts_with(&next) {
                prefix = next;
                continue;
            }
            let rest = &got[prefix.len()..];
            let chosen = top.first().filter(|(p, _)| p == piece).map(|c| c.1);
            let gap = top
                .iter()
                .skip(1)
                .filter(|(p, _)| !p.is_empty() && rest.starts_with(p.as_str()))
                .filter_map(|(_, logit)| Some(chosen? - logit))
                .filter(|g| g.is_finite())
                .fold(f64::INFINITY, f64::min);
            return if gap <= TIE {
                Verdict::Tie { tokens: i, gap }
            } else {
                let gap = gap.is_finite().then_some(gap);
                Verdict::Wrong { tokens: i, gap }
            };
        }
        Verdict::Wrong {
            tokens: self.steps.len(),
            gap: None,
        }
    }
}

/// Each prompt's answer sent alone, one request after another, with its top candidates.
pub async fn solo(
    client: &reqwest::Client,
    base: &str,
    prompts: &[&str],
    tokens: u32,
) -> Result<Vec<Reference>> {
    let mut out = Vec::with_capacity(prompts.len());
    for p in prompts {
        let body = request(p, tokens, true);
        let json = post(client, base, &body).await?;
        out.push(Reference::parse(&json).with_context(|| format!("solo answer to {p:?}"))?);
    }
    Ok(out)
}

/// What one load level measured.
#[derive(Debug, Clone)]
pub struct Level {
    pub clients: usize,
    pub requests: usize,
    /// Wall time from the first request sent to the last answer.
    pub seconds: f64,
    /// Completion tokens of the answered requests.
    pub tokens: u64,
    /// Request latencies (send to whole answer), median and 99th percentile (nearest rank).
    pub p50: f64,
    pub p99: f64,
    /// Answers that part from their prompt's solo answer at a near-tie ([`Verdict::Tie`]), and
    /// the largest such gap.
    pub ties: usize,
    pub max_tie_gap: f64,
    /// Answers that differ from their prompt's solo answer otherwise ([`Verdict::Wrong`]), and
    /// where: (identical leading tokens, logit gap when the token taken was a top candidate).
    pub wrong: usize,
    pub wrong_at: Vec<(usize, Option<f64>)>,
    /// Requests that failed (HTTP or connection errors).
    pub failed: usize,
    /// The first tie, the first wrong answer and the first failure, as text.
    pub first_tie: Option<String>,
    pub first_wrong: Option<String>,
    pub first_failure: Option<String>,
}

impl Level {
    pub fn tok_s(&self) -> f64 {
        self.tokens as f64 / self.seconds
    }

    /// A row of the table under [`HEADER`].
    pub fn row(&self, label: &str) -> String {
        let ties = match self.ties {
            0 => "0".to_string(),
            n => format!("{n} (gap <= {:.3})", self.max_tie_gap),
        };
        format!(
            "| {label} | {} | {} | {:.1} | {:.2} | {:.2} s | {:.2} s | {ties} | {} | {} |",
            self.clients,
            self.requests,
            self.tok_s(),
            self.requests as f64 / self.seconds,
            self.p50,
            self.p99,
            self.wrong,
            self.failed
        )
    }
}

/// The table header [`Level::row`] fills.
pub const HEADER: &str = "| server | clients | requests | tok/s | req/s | p50 | p99 | near-tie | wrong | failed |\n|---|---|---|---|---|---|---|---|---|---|";

/// `clients` concurrent clients send `requests` requests in all, taking the next one from a
/// shared counter as they finish (request `k` asks prompt `k % prompts.len()`).
pub async fn level(
    client: &reqwest::Client,
    base: &str,
    prompts: &[&str],
    solo: &[Reference],
    clients: usize,
    requests: usize,
    tokens: u32,
) -> Level {
    struct Done {
        latencies: Vec<f64>,
        tokens: u64,
        ties: usize,
        max_tie_gap: f64,
        wrong: usize,
        wrong_at: Vec<(usize, Option<f64>)>,
        first_tie: Option<String>,
        first_wrong: Option<String>,
        first_failure: Option<String>,
    }
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(Mutex::new(Done {
        latencies: Vec::with_capacity(requests),
        tokens: 0,
        ties: 0,
        max_tie_gap: 0.0,
        wrong: 0,
        wrong_at: Vec::new(),
        first_tie: None,
        first_wrong: None,
        first_failure: None,
    }));
    let prompts: Arc<Vec<String>> = Arc::new(prompts.iter().map(|p| p.to_string()).collect());
    let solo = Arc::new(solo.to_vec());
    let started = Instant::now();
    let workers: Vec<_> = (0..clients)
        .map(|_| {
            let (client, base) = (client.clone(), base.to_string());
            let (next, done) = (next.clone(), done.clone());
            let (prompts, solo) = (prompts.clone(), solo.clone());
            tokio::spawn(async move {
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    if k >= requests {
                        break;
                    }
                    let i = k % prompts.len();
                    let t0 = Instant::now();
                    let got = ask(&client, &base, &prompts[i], tokens).await;
                    let latency = t0.elapsed().as_secs_f64();
                    let mut d = done.lock().unwrap_or_else(|e| e.into_inner());
                    match got {
                        Ok((answer, n)) => {
                            d.latencies.push(latency);
                            d.tokens += n;
                            let what = || {
                                let (p, alone) = (&prompts[i], &solo[i].text);
                                format!("{p:?}: alone {alone:?}, under load {answer:?}")
                            };
                            match solo[i].judge(&answer) {
                                Verdict::Same => {}
                                Verdict::Tie { tokens, gap } => {
                                    d.ties += 1;
                                    d.max_tie_gap = d.max_tie_gap.max(gap);
                                    d.first_tie.get_or_insert_with(|| {
                                        format!("after {tokens} tokens, gap {gap:.4}: {}", what())
                                    });
                                }
                                Verdict::Wrong { tokens, gap } => {
                                    d.wrong += 1;
                                    d.wrong_at.push((tokens, gap));
                                    let gap = match gap {
                                        Some(g) => format!("a candidate {g:.3} below"),
                                        None => "no top-5 candidate".into(),
                                    };
                                    d.first_wrong.get_or_insert_with(|| {
                                        format!("after {tokens} tokens ({gap}): {}", what())
                                    });
                                }
                            }
                        }
                        Err(e) => {
                            d.first_failure.get_or_insert_with(|| format!("{e:#}"));
                        }
                    }
                }
            })
        })
        .collect();
    for w in workers {
        // A worker only panics if the runtime is shutting down; its requests count as failed.
        let _ = w.await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let mut d = done.lock().unwrap_or_else(|e| e.into_inner());
    d.latencies.sort_by(f64::total_cmp);
    let failed = requests - d.latencies.len();
    Level {
        clients,
        requests,
        seconds,
        tokens: d.tokens,
        p50: percentile(&d.latencies, 0.50),
        p99: percentile(&d.latencies, 0.99),
        ties: d.ties,
        max_tie_gap: d.max_tie_gap,
        wrong: d.wrong,
        wrong_at: std::mem::take(&mut d.wrong_at),
        failed,
        first_tie: d.first_tie.take(),
        first_wrong: d.first_wrong.take(),
        first_failure: d.first_failure.take(),
    }
}

/// Nearest-rank percentile of sorted values (NaN when there are none).
fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The solo answers, then one [`level`] per entry of `clients`, each sending `rounds` requests
/// per prompt; prints the table rows under `label` as they come.
pub async fn run(
    base: &str,
    label: &str,
    clients: &[usize],
    rounds: usize,
    tokens: u32,
) -> Result<Vec<Level>> {
    let client = reqwest::Client::new();
    let prompts = &PROMPTS[..];
    let alone = solo(&client, base, prompts, tokens).await?;
    let mut levels = Vec::new();
    for &c in clients {
        let l = level(
            &client,
            base,
            prompts,
            &alone,
            c,
            rounds * prompts.len(),
            tokens,
        )
        .await;
        println!("{}", l.row(label));
        levels.push(l);
    }
    Ok(levels)
}

#[cfg(test)]
mod tests {
    use super::{percentile, Reference, Verdict};

    fn reference() -> Reference {
        let step = |piece: &str, top: &[(&str, f64)]| {
            let top = top.iter().map(|(p, l)| (p.to_string(), *l)).collect();
            (piece.to_string(), top)
        };
        Reference {
            text: "Bees make honey".into(),
            steps: vec![
                step("Bees", &[("Bees", 30.0), ("The", 28.0)]),
                step(
                    " make",
                    &[(" make", 20.0), (" produce", 19.99), (" are", 12.0)],
                ),
                step(" honey", &[(" honey", 25.0), (" wax", 24.0)]),
            ],
        }
    }

    #[test]
    fn answers_are_judged_against_the_solo_candidates() {
        let r = reference();
        assert_eq!(r.judge("Bees make honey"), Verdict::Same);
        match r.judge("Bees produce wax") {
            Verdict::Tie { tokens: 1, gap } => assert!((gap - 0.01).abs() < 1e-9),
            v => panic!("{v:?}"),
        }
        // A candidate, but no near-tie; an answer to another prompt; a longer answer.
        let wrong = |tokens, gap| Verdict::Wrong { tokens, gap };
        assert_eq!(r.judge("Bees are small"), wrong(1, Some(8.0)));
        assert_eq!(r.judge("The number 4"), wrong(0, Some(2.0)));
        assert_eq!(r.judge("A number"), wrong(0, None));
        assert_eq!(r.judge("Bees make wax"), wrong(2, Some(1.0)));
        assert_eq!(r.judge("Bees make honey."), wrong(3, None));
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&v[..32], 0.99), 32.0);
        assert_eq!(percentile(&[7.0], 0.5), 7.0);
        assert!(percentile(&[], 0.5).is_nan());
    }
}
