fn main() {
    println!("deepinfer");
}
