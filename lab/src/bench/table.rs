//! Markdown tables for benchmark results.

/// A titled table of strings.
#[derive(Debug, Default)]
pub struct Table {
    /// The heading, above the table.
    pub title: String,
    /// Column names.
    pub header: Vec<String>,
    /// Rows of cells, one per column.
    pub rows: Vec<Vec<String>>,
    /// Paragraphs printed below the table.
    pub notes: Vec<String>,
}

impl Table {
    /// An empty table with `title` and columns `header`.
    pub fn new(title: impl Into<String>, header: &[&str]) -> Self {
        Table {
            title: title.into(),
            header: header.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    /// Appends a row.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Appends a note.
    pub fn note(&mut self, note: impl Into<String>) {
        self.notes.push(note.into());
    }

    /// The table as Markdown: heading, table, notes.
    pub fn render(&self) -> String {
        let mut out = format!("### {}\n\n", self.title);
        let line = |cells: &[String]| format!("| {} |\n", cells.join(" | "));
        out += &line(&self.header);
        out += &line(&vec!["---".to_string(); self.header.len()]);
        for r in &self.rows {
            out += &line(r);
        }
        for n in &self.notes {
            out += &format!("\n{n}\n");
        }
        out
    }

    /// Prints [`render`](Self::render) to stdout.
    pub fn print(&self) {
        println!("{}", self.render());
    }
}

/// Formats nanoseconds with thousands separators, as RMM's tables do.
pub fn ns(v: f64) -> String {
    let s = format!("{:.0}", v);
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}
