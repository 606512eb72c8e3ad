//! Choosing the sampler in TOML: swapping `standard` for `greedy` (or the third-party typical-p
//! example) changes what is sampled, with no rebuild; `plugins list` data shows each with its
//! ABI version and hash.

#[path = "plugins/common.rs"]
mod common;

use common::*;
use deepinfer::config::Config;
use deepinfer::plugins::{describe, CacheDir, PluginEngine, PluginKind};
use deepinfer::sampling::BatchSampler;

const STEPS: u64 = 48;

/// Samples STEPS tokens through the sampler a config file names.
fn tokens_with(config_text: &str) -> (Vec<u32>, Vec<u32>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("deepinfer.toml");
    std::fs::write(&path, config_text).unwrap();
    let cfg = Config::load(&path).expect("config loads");
    let params = cfg.sampler.params().expect("params");
    let (_cache, host) = host();
    let s = load(&host, &cfg);
    let mut picked = Vec::new();
    let mut argmaxes = Vec::new();
    for step in 0..STEPS {
        // Flat-ish logits so that sampling at temperature 1 really varies.
        let l: Vec<f32> = logits(3, step, 4096).iter().map(|v| v * 0.1).collect();
        argmaxes.push(argmax(&l));
        picked.push(
            sample_one(&s, &l, &params, params.seed.unwrap_or(0), step, &[]).expect("sampled"),
        );
    }
    (picked, argmaxes)
}

#[test]
fn swapping_standard_for_greedy_in_toml_changes_behaviour() {
    let base = "temperature = 1.0\nseed = 7\n";
    let (standard, argmaxes) = tokens_with(&format!("[sampler]\nplugin = \"standard\"\n{base}"));
    let (greedy, _) = tokens_with(&format!("[sampler]\nplugin = \"greedy\"\n{base}"));
    assert_eq!(
        greedy, argmaxes,
        "greedy always takes the argmax, whatever the temperature"
    );
    let differ = standard
        .iter()
        .zip(&argmaxes)
        .filter(|(a, b)| a != b)
        .count();
    assert!(
        differ > STEPS as usize / 4,
        "standard at temperature 1 samples ({differ} of {STEPS} differ)"
    );
    // Same file, same tokens: nothing else changed but the plugin name.
    let (again, _) = tokens_with(&format!("[sampler]\nplugin = \"standard\"\n{base}"));
    assert_eq!(standard, again);
}

#[test]
fn the_third_party_example_loads_from_a_file_with_its_settings() {
    let path = test_plugin("typical");
    let sha = sha_of(&path);
    let text = format!(
        "[sampler]\nplugin = \"typical\"\ntemperature = 1.0\nseed = 7\n\
         [plugins.typical]\npath = {path:?}\nsha256 = \"{sha}\"\nsettings = {{ mass = 0.5 }}\n"
    );
    let (typical, argmaxes) = tokens_with(&text);
    assert_ne!(typical, argmaxes);
    // A setting the plugin does not know fails loading, naming the setting.
    let bad = config(&text.replace("mass = 0.5", "mas = 0.5"));
    let (_cache, host) = host();
    let err = host
        .load_sampler(&bad, "typical")
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("mas") && err.contains("configure"), "{err}");
}

#[test]
fn list_data_shows_kind_abi_hash_and_cache_state() {
    let cfg = Config::default();
    let dir = tempfile::tempdir().unwrap();
    let cache = CacheDir::At(dir.path().to_path_buf());
    let engine = PluginEngine::without_ticker(&cache).unwrap();
    let mut shas = Vec::new();
    for name in ["standard", "greedy"] {
        let d = describe(&cfg, name, &engine).expect("described");
        let s = d.summary.as_ref().expect("passes the ABI check");
        assert_eq!(s.kind, PluginKind::Sampler);
        assert_eq!(s.abi.to_string(), "0.1.0");
        assert_eq!(d.source.sha256.len(), 64);
        assert!(!d.cached, "nothing compiled yet");
        shas.push(d.source.sha256.clone());
    }
    assert_ne!(shas[0], shas[1]);
    // Loading compiles once and fills the cache; `describe` then says so.
    let host = deepinfer::plugins::PluginHost::new(&cache).unwrap();
    host.load_sampler(&cfg, "standard").unwrap();
    assert!(describe(&cfg, "standard", &engine).unwrap().cached);
    assert!(!describe(&cfg, "greedy", &engine).unwrap().cached);
}

#[test]
fn build_sampler_uses_the_sampler_the_config_names() {
    let dir = tempfile::tempdir().unwrap();
    // SAFETY of the test: only this test in this binary reads the variable.
    std::env::set_var("DEEPINFER_CACHE_DIR", dir.path());
    let cfg = config("[sampler]\nplugin = \"greedy\"\n");
    let s = deepinfer::plugins::build_sampler(&cfg).expect("builds");
    let l = logits(1, 0, 1000);
    let p = deepinfer::sampling::SamplingParams {
        temperature: 2.0,
        ..Default::default()
    };
    assert_eq!(sample_one(&*s, &l, &p, 1, 0, &[]), Ok(argmax(&l)));
    assert!(
        dir.path().join("plugins").read_dir().unwrap().count() > 0,
        "compiled form cached"
    );
    let missing = config("[sampler]\nplugin = \"nonesuch\"\n");
    let err = deepinfer::plugins::build_sampler(&missing)
        .err()
        .expect("unknown plugin")
        .to_string();
    assert!(
        err.contains("nonesuch") && err.contains("standard"),
        "{err}"
    );
    let _: &dyn BatchSampler = &*s;
}
