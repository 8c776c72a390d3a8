//! `kiln train gpt2|llama|bert|roberta|distilbert|t5`: every model of the zoo learns
//! from a text file with a tokenizer trained on it, compiling one program per
//! batch shape (bucket) and no more; a run writes a Hugging Face directory
//! with its tokenizer that the next run starts from; bad input is refused
//! naming the file, line, model or flag, before training.

#![allow(clippy::unwrap_used)] // Test helpers may unwrap (the workspace denies it in library code).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn kiln() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kiln"));
    cmd.env("KILN_CACHE", "off").env_remove("KILN_CPU_DEVICES").env_remove("PJRT_DEVICE");
    cmd
}

fn ok(out: &Output) -> String {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn refused(out: &Output) -> String {
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Sentences of a small grammar, `n` lines of varying length: enough
/// structure for a tiny model to learn in 100 steps.
fn corpus(dir: &Path, n: usize) -> PathBuf {
    let subjects = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher"];
    let verbs = ["sees", "likes", "follows", "finds", "watches", "helps"];
    let objects = ["the ball", "a red car", "the garden", "an apple", "the river", "a quiet house"];
    let adverbs = ["today", "every morning", "in the rain", "at night", "slowly", "again"];
    let mut text = String::new();
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut pick = |k: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % k as u64) as usize
    };
    for _ in 0..n {
        text += &format!("{} {} {}", subjects[pick(6)], verbs[pick(6)], objects[pick(6)]);
        for _ in 0..pick(3) {
            text += &format!(" {}", adverbs[pick(6)]);
        }
        if pick(3) == 0 {
            text += &format!(" and {} {} {}", subjects[pick(6)], verbs[pick(6)], objects[pick(6)]);
        }
        text += " .\n";
    }
    let path = dir.join("text.txt");
    std::fs::write(&path, text).unwrap();
    path
}

fn train(model: &str, text: &Path, extra: &[&str]) -> Value {
    let out = kiln().args(["train", model, "--json", "--text"]).arg(text).args(extra).output().unwrap();
    serde_json::from_str(ok(&out).lines().last().unwrap()).unwrap()
}

#[test]
fn every_model_learns_its_task_with_one_compile_per_bucket() {
    let dir = tempfile::tempdir().unwrap();
    let text = corpus(dir.path(), 400);
    for model in ["gpt2", "llama", "bert", "roberta", "distilbert", "t5"] {
        let r = train(model, &text, &["--steps", "100"]);
        let losses: Vec<f64> = r["losses"].as_array().unwrap().iter().map(|l| l.as_f64().unwrap()).collect();
        let first = losses[0];
        let last10 = losses[90..].iter().sum::<f64>() / 10.0;
        eprintln!("{model}: loss {first:.3} -> {last10:.3} (last 10 steps), eval {}", r["eval"]);
        // From about ln(vocab) (uniform guesses) to well below it.
        assert!(last10 < 0.8 * first, "{model}: the loss did not fall: {first} -> {last10}");
        let eval = &r["eval"].as_array().unwrap()[0];
        assert!(eval["loss"].as_f64().unwrap() < 0.8 * first, "{model}: held-out {eval}");
        assert!(eval["accuracy"].as_f64().unwrap() > 0.1, "{model}: held-out {eval}");
        // One training program per batch shape used, one evaluation program
        // per held-out shape: no recompile beyond the buckets.
        let shapes = r["buckets_used"].as_array().unwrap().len() + r["eval_buckets_used"].as_array().unwrap().len();
        assert_eq!(r["compiles"].as_u64().unwrap() as usize, shapes, "{model}: {r}");
        let allowed: Vec<u64> = r["bucket_lengths"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap()).collect();
        assert_eq!(allowed, vec![8, 16, 32]);
        if matches!(model, "bert" | "roberta") {
            // Lines of different lengths: more than one bucket (T5's inputs
            // of 8 lines, its sentinels and pieces, all reach 32 here).
            assert!(r["buckets_used"].as_array().unwrap().len() > 1, "{model}: {r}");
        }
    }
}

#[test]
fn a_saved_hugging_face_directory_is_where_the_next_run_starts() {
    let dir = tempfile::tempdir().unwrap();
    let text = corpus(dir.path(), 120);
    let saved = dir.path().join("bert-out");
    let r = train("bert", &text, &["--steps", "30", "--save-hf", saved.to_str().unwrap()]);
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(saved.join(f).is_file(), "{f} missing");
    }
    let tok = saved.join("tokenizer.json");
    let again = train(
        "bert",
        &text,
        &["--steps", "5", "--init", &format!("hf:{}", saved.display()), "--tokenizer", tok.to_str().unwrap()],
    );
    assert_eq!(again["vocab"], r["vocab"]);
    assert_eq!(again["parameters"], r["parameters"]);
    // It continues from the saved weights, not from a fresh start.
    let fresh_first = r["first_loss"].as_f64().unwrap();
    let resumed_first = again["first_loss"].as_f64().unwrap();
    assert!(resumed_first < 0.9 * fresh_first, "fresh {fresh_first}, from the directory {resumed_first}");
    let (_, model) = kiln::models::hf::load(&saved, kiln::models::Spelling::Builtin).unwrap();
    assert_eq!(model.model_type(), "bert");
}

/// `label<TAB>text` lines whose label the words decide.
fn labelled(dir: &Path, n: usize) -> PathBuf {
    let good = ["great", "wonderful", "lovely", "excellent", "happy"];
    let bad = ["terrible", "awful", "sad", "horrible", "dull"];
    let things = ["movie", "day", "meal", "book", "song", "garden"];
    let mut text = String::new();
    for i in 0..n {
        let (label, words) = if (i * 7 + i / 3) % 2 == 0 { ("pos", &good) } else { ("neg", &bad) };
        let (w, t) = (words[(i * 3) % 5], things[(i * 5) % 6]);
        let line = match i % 3 {
            0 => format!("the {t} was {w}"),
            1 => format!("what a {w} {t}"),
            _ => format!("i found the {t} {w} today"),
        };
        text += &format!("{label}\t{line}\n");
    }
    let path = dir.join("labels.tsv");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn bert_roberta_and_distilbert_learn_to_classify_labelled_lines() {
    let dir = tempfile::tempdir().unwrap();
    let data = labelled(dir.path(), 200);
    for model in ["bert", "roberta", "distilbert"] {
        let out = dir.path().join(format!("{model}-cls"));
        let r = kiln()
            .args(["train", model, "--json", "--steps", "60", "--data"])
            .arg(&data)
            .arg("--save-hf")
            .arg(&out)
            .output()
            .unwrap();
        let r: Value = serde_json::from_str(ok(&r).lines().last().unwrap()).unwrap();
        assert_eq!(r["task"], "sequence classification");
        assert_eq!(r["classes"], serde_json::json!(["neg", "pos"]));
        let eval = &r["eval"][0];
        assert!(eval["accuracy"].as_f64().unwrap() >= 0.9, "{model}: {eval}");
        // The directory is a classifier with the classes named.
        let (_, m) = kiln::models::hf::load(&out, kiln::models::Spelling::Builtin).unwrap();
        match m {
            kiln::models::hf::HfModel::BertClassifier(c) => assert_eq!(c.labels, ["neg", "pos"]),
            _ => panic!("{model}: not a classifier"),
        }
        // Data with a class the saved classifier does not have.
        let other = dir.path().join("other.tsv");
        std::fs::write(&other, "pos\tthe movie was great\nmaybe\tthe day was dull\npos\ta lovely song\n").unwrap();
        let e = refused(
            &kiln()
                .args(["train", model, "--data"])
                .arg(&other)
                .arg("--init")
                .arg(format!("hf:{}", out.display()))
                .arg("--tokenizer")
                .arg(out.join("tokenizer.json"))
                .output()
                .unwrap(),
        );
        assert!(e.contains("line 2: label \"maybe\" is not one of the model's classes [\"neg\", \"pos\"]"), "{e}");
    }
}

#[test]
fn bad_input_is_refused_before_training_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let text = corpus(dir.path(), 120);
    let run = |args: &[&str]| kiln().args(["train"]).args(args).output().unwrap();
    let t = text.to_str().unwrap();

    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "\n\n").unwrap();
    let e = refused(&run(&["bert", "--text", empty.to_str().unwrap()]));
    assert!(e.contains("empty.txt") && e.contains("0 non-blank line(s)"), "{e}");
    let one = dir.path().join("one.txt");
    std::fs::write(&one, "a single line of text\n").unwrap();
    assert!(refused(&run(&["gpt2", "--text", one.to_str().unwrap()])).contains("1 non-blank line(s)"));
    let binary = dir.path().join("binary.txt");
    std::fs::write(&binary, [0x66, 0x6f, 0xff, 0xfe, 0x0a, 0x61, 0x0a]).unwrap();
    assert!(refused(&run(&["t5", "--text", binary.to_str().unwrap()])).contains("not UTF-8"));

    let untabbed = dir.path().join("untabbed.tsv");
    std::fs::write(&untabbed, "pos\tfine\nno tab on this line\n").unwrap();
    let e = refused(&run(&["bert", "--data", untabbed.to_str().unwrap()]));
    assert!(e.contains("untabbed.tsv") && e.contains("line 2: no tab"), "{e}");
    let e = refused(&run(&["t5", "--data", untabbed.to_str().unwrap()]));
    assert!(e.contains("line 2: no tab: a pair is `source<TAB>target`"), "{e}");
    let e = refused(&run(&["gpt2", "--data", untabbed.to_str().unwrap()]));
    assert!(e.contains("is not for gpt2"), "{e}");
    let e = refused(&run(&["bert", "--text", t, "--config", "huge"]));
    assert!(e.contains("--config huge: bert has tiny, bert-base-uncased"), "{e}");
    let usage = run(&["bert", "--text", t, "--tokenizer", "wordpiece:x"]);
    assert_eq!(usage.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&usage.stderr).contains("wordpiece:N takes a vocabulary size N"));
    let e = refused(&run(&["bert", "--text", t, "--tokenizer", "/nonexistent/tokenizer.json"]));
    assert!(e.contains("/nonexistent/tokenizer.json"), "{e}");
    let e = refused(&run(&["bert", "--text", t, "--init", "hf:"]));
    assert!(e.contains("give hf:DIR"), "{e}");
    let e = refused(&run(&["bert", "--text", t, "--save-hf", "/sys/kernel/kiln-zoo-out"]));
    assert!(e.contains("--save-hf /sys/kernel/kiln-zoo-out"), "{e}");

    // A directory of another architecture, and one whose vocabulary is
    // smaller than the tokenizer's.
    let small = dir.path().join("gpt2-small-vocab");
    train("gpt2", &text, &["--steps", "2", "--tokenizer", "wordpiece:40", "--save-hf", small.to_str().unwrap()]);
    let init = format!("hf:{}", small.display());
    let e = refused(&run(&["t5", "--text", t, "--init", &init]));
    assert!(e.contains("a gpt2 model, not t5"), "{e}");
    let e = refused(&run(&["gpt2", "--text", t, "--init", &init, "--tokenizer", "bpe:1000"]));
    assert!(e.contains("smaller than the tokenizer's"), "{e}");
    let e = refused(&run(&["gpt2", "--text", t, "--init", &init, "--tokenizer", "wordpiece:40", "--seq", "64"]));
    assert!(e.contains("fewer than --seq 64"), "{e}");

    // Text a tokenizer does not cover trains, and says how much of it is unknown.
    let odd = dir.path().join("odd.txt");
    std::fs::write(&odd, "zzz qqq xxx\n\u{e9}\u{e9} \u{e7}\u{e7}\nthe cat\n".repeat(5)).unwrap();
    let tok = small.join("tokenizer.json");
    let out = run(&["bert", "--text", odd.to_str().unwrap(), "--tokenizer", tok.to_str().unwrap(), "--steps", "2"]);
    ok(&out);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("are the tokenizer's unknown token"), "{said}");
}

#[test]
fn generate_continues_a_prompt_from_a_saved_decoder() {
    let dir = tempfile::tempdir().unwrap();
    let text = corpus(dir.path(), 200);
    for model in ["gpt2", "llama"] {
        let saved = dir.path().join(model);
        train(model, &text, &["--steps", "50", "--save-hf", saved.to_str().unwrap()]);
        let hf = format!("hf:{}", saved.display());
        let out = kiln()
            .args([
                "generate",
                &hf,
                "--prompt",
                "the old man",
                "--temperature",
                "0",
                "--max-new-tokens",
                "12",
                "--json",
            ])
            .output()
            .unwrap();
        let r: Value = serde_json::from_str(ok(&out).lines().last().unwrap()).unwrap();
        let n = r["new_tokens"].as_u64().unwrap();
        assert!((1..=12).contains(&n), "{model}: {r}");
        assert!(r["programs"].as_u64().unwrap() <= 2, "{model}: {r}");
        // Learnt from the text: the words it continues with are the text's.
        let words = r["text"].as_str().unwrap().split_whitespace().count();
        assert!(words >= 1, "{model}: {r}");
        // Sampled, seeded: the same seed gives the same text.
        let sampled = |seed: &str| {
            let o = kiln()
                .args([
                    "generate", &hf, "--prompt", "a dog", "--top-k", "5", "--top-p", "0.9", "--seed", seed, "--json",
                ])
                .output()
                .unwrap();
            let v: Value = serde_json::from_str(ok(&o).lines().last().unwrap()).unwrap();
            v["tokens"].clone()
        };
        assert_eq!(sampled("4"), sampled("4"), "{model}: one seed, two texts");
    }
    let e = refused(&kiln().args(["generate", "hf:/nonexistent-kiln-model", "--prompt", "x"]).output().unwrap());
    assert!(e.contains("nonexistent-kiln-model"), "{e}");
    let gpt2 = format!("hf:{}", dir.path().join("gpt2").display());
    let e = refused(&kiln().args(["generate", &gpt2, "--prompt", "x", "--top-p", "0"]).output().unwrap());
    assert!(e.contains("top_p"), "{e}");
    let long = "the cat sees the ball ".repeat(20);
    let e = refused(&kiln().args(["generate", &gpt2, "--prompt", &long]).output().unwrap());
    assert!(e.contains("more than the context of 32"), "{e}");
    let classifier = dir.path().join("cls");
    let data = labelled(dir.path(), 60);
    kiln()
        .args(["train", "bert", "--steps", "2", "--data"])
        .arg(&data)
        .arg("--save-hf")
        .arg(&classifier)
        .output()
        .unwrap();
    let e =
        refused(&kiln().args(["generate", &format!("hf:{}", classifier.display()), "--prompt", "x"]).output().unwrap());
    assert!(e.contains("a bert model; generation needs a decoder"), "{e}");
}

#[test]
fn the_log_holds_each_steps_gradient_norm_and_the_evaluations() {
    let dir = tempfile::tempdir().unwrap();
    let text = corpus(dir.path(), 100);
    let log = dir.path().join("run.jsonl");
    train("gpt2", &text, &["--steps", "6", "--eval-every", "3", "--log", log.to_str().unwrap()]);
    let lines: Vec<Value> =
        std::fs::read_to_string(&log).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let steps: Vec<&Value> = lines.iter().filter(|l| l["kind"] == "step").collect();
    assert_eq!(steps.len(), 6);
    for s in &steps {
        let norm = s["grad_norm"].as_f64().unwrap();
        assert!(norm.is_finite() && norm > 0.0, "{s}");
    }
    let evals: Vec<u64> = lines
        .iter()
        .filter(|l| l["kind"] == "eval" && l.get("eval_loss").is_some())
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evals, [3, 6]);
}

#[test]
fn keep_best_holds_the_step_of_the_lowest_held_out_loss() {
    let dir = tempfile::tempdir().unwrap();
    let text = corpus(dir.path(), 100);
    let best = dir.path().join("best.ckpt");
    let r = train("llama", &text, &["--steps", "40", "--eval-every", "10", "--keep-best", best.to_str().unwrap()]);
    let evals = r["eval"].as_array().unwrap();
    assert_eq!(evals.len(), 4, "{r}");
    let lowest =
        evals.iter().min_by(|a, b| a["loss"].as_f64().unwrap().total_cmp(&b["loss"].as_f64().unwrap())).unwrap();
    let saved = kiln::checkpoint::load(&best).unwrap();
    assert_eq!(saved.step, lowest["step"].as_u64().unwrap(), "{r}");
    // It carries the run's tokenizer, as the run's checkpoints do.
    assert!(saved.tensors.iter().any(|(n, _)| n == kiln::models::zoo::TOKENIZER));
}

#[test]
fn t5_learns_source_target_pairs() {
    let dir = tempfile::tempdir().unwrap();
    let words = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree"];
    let mut text = String::new();
    for i in 0..200usize {
        let n = 2 + i % 4;
        let src: Vec<&str> = (0..n).map(|j| words[(i * 3 + j * 5 + i / 7) % 8]).collect();
        let rev: Vec<&str> = src.iter().rev().copied().collect();
        text += &format!("{}\t{}\n", src.join(" "), rev.join(" "));
    }
    let data = dir.path().join("pairs.tsv");
    std::fs::write(&data, text).unwrap();
    let out = kiln()
        .args(["train", "t5", "--json", "--steps", "120", "--tokenizer", "wordpiece:60", "--data"])
        .arg(&data)
        .output()
        .unwrap();
    let r: Value = serde_json::from_str(ok(&out).lines().last().unwrap()).unwrap();
    assert_eq!(r["task"], "sequence to sequence");
    let losses: Vec<f64> = r["losses"].as_array().unwrap().iter().map(|l| l.as_f64().unwrap()).collect();
    let last10 = losses[110..].iter().sum::<f64>() / 10.0;
    assert!(last10 < 0.5 * losses[0], "{} -> {last10}", losses[0]);
    let shapes = r["buckets_used"].as_array().unwrap().len() + r["eval_buckets_used"].as_array().unwrap().len();
    assert_eq!(r["compiles"].as_u64().unwrap() as usize, shapes, "{r}");
}

#[test]
fn each_replica_or_data_rank_trains_on_its_own_rows() {
    let dir = tempfile::tempdir().unwrap();
    let text = corpus(dir.path(), 150);
    let run = |devices: &str, batch: &str| -> Value {
        let out = kiln()
            .env("KILN_CPU_DEVICES", devices)
            .args(["train", "gpt2", "--json", "--steps", "8", "--tokenizer", "bpe:300", "--batch", batch, "--text"])
            .arg(&text)
            .output()
            .unwrap();
        serde_json::from_str(ok(&out).lines().last().unwrap()).unwrap()
    };
    // Two replicas of 4 rows draw the 8 rows one replica of 8 draws: the
    // same global batch, so the same losses (f32 means of equal halves).
    let (one, two) = (run("1", "8"), run("2", "4"));
    let losses =
        |r: &Value| -> Vec<f64> { r["losses"].as_array().unwrap().iter().map(|l| l.as_f64().unwrap()).collect() };
    for (a, b) in losses(&one).iter().zip(losses(&two)) {
        assert!((a - b).abs() < 1e-4, "{:?} vs {:?}", losses(&one), losses(&two));
    }
    let eval = |r: &Value| r["eval"][0]["loss"].as_f64().unwrap();
    assert!((eval(&one) - eval(&two)).abs() < 1e-4, "{} vs {}", eval(&one), eval(&two));

    // Sharded: FSDP over 2 devices with 4 rows a data rank is the same global
    // batch; tensor parallelism over both has one data rank of 4 rows.
    let sharded = |spec: &str| -> Value {
        let out = kiln()
            .env("KILN_CPU_DEVICES", "2")
            .args([
                "train",
                "gpt2",
                "--json",
                "--steps",
                "8",
                "--tokenizer",
                "bpe:300",
                "--batch",
                "4",
                "--shard",
                spec,
            ])
            .arg("--text")
            .arg(&text)
            .output()
            .unwrap();
        serde_json::from_str(ok(&out).lines().last().unwrap()).unwrap()
    };
    let four = run("1", "4");
    for (spec, like) in [("fsdp", &one), ("tp=2", &four)] {
        let r = sharded(spec);
        // The parameters are split, not replicated: FSDP splits the large
        // ones, tensor parallelism the Megatron pairs (c_attn, c_fc and their
        // row Linears, two layers: 8 weights and the 4 column biases).
        let split = r["sharded_parameters"].as_u64().unwrap();
        assert!(if spec == "tp=2" { split == 12 } else { split > 12 }, "{spec}: {split} sharded: {r}");
        for (a, b) in losses(like).iter().zip(losses(&r)) {
            assert!((a - b).abs() < 1e-4, "{spec}: {:?} vs {:?}", losses(like), losses(&r));
        }
    }
}
