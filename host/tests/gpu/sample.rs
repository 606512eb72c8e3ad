//! Argmax and top-K on the device against the host versions, with ties and odd widths.

use deepinfer::backend::cuda::Act;
use deepinfer::backend::{select, Backend};

use super::util::{backend, upload, Rng};

#[test]
fn argmax_and_top_k_match_the_host_versions() {
    let mut rng = Rng::fresh("select");
    for act in [Act::F32, Act::Bf16] {
        let Some(be) = backend(act) else { return };
        for (rows, width) in [(1usize, 10usize), (3, 1000), (5, 49152), (2, 128_257)] {
            // Values on a coarse grid, so ties are common and exact in bf16 too.
            let mut x: Vec<f32> = (0..rows * width)
                .map(|_| (rng.f32() * 64.0).round() / 8.0)
                .collect();
            x[width / 2] = 9.0; // a unique maximum in row 0
            let xb = upload(&be, rows, width, &x);
            let host = be.to_host(&xb).unwrap(); // the values as the device holds them
            assert_eq!(
                be.argmax_rows(&xb, width).unwrap(),
                select::argmax_rows(&host, width),
                "{act:?} argmax {rows}x{width}"
            );
            for k in [1usize, 5, 50, 1000] {
                let k = k.min(width);
                let got = be.top_k_rows(&xb, width, k).unwrap();
                let want = select::top_k_rows(&host, width, k);
                assert_eq!(got, want, "{act:?} top-{k} of {rows}x{width}");
            }
        }
    }
}
