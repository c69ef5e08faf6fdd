use super::*;

fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}

#[test]
fn rotary_matches_the_formula_on_every_thread_count() {
    let (t, row_heads, heads, d) = (300, 5, 4, 8);
    let row = row_heads * d;
    let positions: Vec<i64> = (0..t as i64).map(|i| (i * 7) % 50).collect();
    let cos = values(50 * d / 2, 3);
    let sin = values(50 * d / 2, 4);
    let x0 = values(t * row, 5);
    for threads in [1, 2, 3] {
        let mut x = x0.clone();
        rotary_in_place(&mut x, row, heads, d, &positions, &cos, &sin, threads).unwrap();
        for (tok, &pos) in positions.iter().enumerate() {
            let p = pos as usize;
            for h in 0..row_heads {
                for j in 0..d / 2 {
                    let (i1, i2) = (tok * row + h * d + j, tok * row + h * d + d / 2 + j);
                    let (c, s) = (cos[p * d / 2 + j], sin[p * d / 2 + j]);
                    let (e1, e2) = if h < heads {
                        (x0[i1] * c - x0[i2] * s, x0[i2] * c + x0[i1] * s)
                    } else {
                        (x0[i1], x0[i2]) // heads past num_heads stay as they were
                    };
                    assert_eq!((x[i1], x[i2]), (e1, e2));
                }
            }
        }
    }
}

#[test]
fn a_partial_rotary_turns_the_leading_dimensions_of_each_head_only() {
    // Heads of 12, of which the first 4 rotate (Qwen3.5's quarter): as a
    // whole rotary over heads of 4, the other 8 dimensions untouched.
    let (t, heads, d, r) = (3, 2, 12, 4);
    let positions = [0i64, 5, 2];
    let (cos, sin) = (values(8 * r / 2, 1), values(8 * r / 2, 2));
    let x0 = values(t * heads * d, 3);
    let mut x = x0.clone();
    let layout = RotaryHeads {
        row_len: heads * d,
        num_heads: heads,
        head_dim: d,
        rotary_dim: r,
    };
    rotary_partial_in_place(&mut x, &layout, &positions, &cos, &sin, 1).unwrap();
    for tok in 0..t {
        for h in 0..heads {
            let at = (tok * heads + h) * d;
            let mut want = x0[at..at + r].to_vec();
            let p = &positions[tok..tok + 1];
            rotary_in_place(&mut want, r, 1, r, p, &cos, &sin, 1).unwrap();
            assert_eq!(&x[at..at + r], &want[..]);
            assert_eq!(&x[at + r..at + d], &x0[at + r..at + d]);
        }
    }
    let odd = RotaryHeads {
        rotary_dim: 3,
        ..layout
    };
    assert!(rotary_partial_in_place(&mut x, &odd, &positions, &cos, &sin, 1).is_err());
}

#[test]
fn rotary_rejects_bad_positions_and_shapes() {
    let mut x = vec![0.0; 16];
    let cs = vec![0.0; 8];
    assert!(rotary_in_place(&mut x, 8, 1, 8, &[0, 2], &cs, &cs, 1).is_err()); // 2 positions only
    assert!(rotary_in_place(&mut x, 8, 1, 8, &[0, -1], &cs, &cs, 1).is_err());
    assert!(rotary_in_place(&mut x, 8, 2, 8, &[0, 1], &cs, &cs, 1).is_err());
    assert!(rotary_in_place(&mut x, 16, 1, 8, &[0], &cs, &cs, 1).is_ok());
}

#[test]
fn add_rms_norm_matches_a_plain_computation() {
    let (t, hidden) = (700, 96);
    let res0 = values(t * hidden, 7);
    let delta = values(t * hidden, 8);
    let weight = values(hidden, 9);
    for threads in [1, 2] {
        for with_delta in [false, true] {
            let mut res = res0.clone();
            let mut out = vec![0.0; res.len()];
            let d = with_delta.then_some(delta.as_slice());
            add_rms_norm(&mut res, d, &weight, 1e-5, &mut out, threads).unwrap();
            for r in 0..t {
                let row: Vec<f64> = (0..hidden)
                    .map(|i| {
                        res0[r * hidden + i] as f64
                            + if with_delta {
                                delta[r * hidden + i] as f64
                            } else {
                                0.0
                            }
                    })
                    .collect();
                let mean = row.iter().map(|v| v * v).sum::<f64>() / hidden as f64;
                for i in 0..hidden {
                    let want = weight[i] as f64 * row[i] / (mean + 1e-5).sqrt();
                    assert!(
                        (out[r * hidden + i] as f64 - want).abs() < 1e-5,
                        "row {r} col {i}"
                    );
                    assert!((res[r * hidden + i] as f64 - row[i]).abs() < 1e-6);
                }
            }
        }
    }
}
