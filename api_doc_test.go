package once_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"

	"github.com/once-dev/once/pipeline"
)

type docEvent struct{}

func (docEvent) EventID() uuid.UUID { return uuid.Nil }

// listedField is a field of an alias's doc list: "  - Name: ..." (or
// "  - User, Password: ...").
var listedField = regexp.MustCompile(`(?m)^\s*- ([A-Z]\w*(?:, [A-Z]\w*)*):`)

// Issue 28, item 8f: go doc of once.Group and once.Topic showed the alias
// and nothing of the fields a team fills in. Each alias a team fills in
// lists its fields in its doc; a field added to the pipeline's type and not
// to the list (or a list naming a field that is gone) fails here.
func TestTheAliasesListTheirFields(t *testing.T) {
	f, err := parser.ParseFile(token.NewFileSet(), "api.go", nil, parser.ParseComments)
	if err != nil {
		t.Fatal(err)
	}
	docs := map[string]string{}
	for _, d := range f.Decls {
		if gd, ok := d.(*ast.GenDecl); ok && gd.Tok == token.TYPE {
			for _, s := range gd.Specs {
				if ts := s.(*ast.TypeSpec); ts.Assign.IsValid() && ts.Doc != nil {
					docs[ts.Name.Name] = ts.Doc.Text()
				}
			}
		}
	}
	for alias, typ := range map[string]reflect.Type{
		"Topic":         reflect.TypeFor[pipeline.Topic[docEvent]](),
		"Group":         reflect.TypeFor[pipeline.Group[docEvent]](),
		"Batch":         reflect.TypeFor[pipeline.Batch](),
		"Extra":         reflect.TypeFor[pipeline.Extra](),
		"Outgoing":      reflect.TypeFor[pipeline.Outgoing[docEvent]](),
		"Hooks":         reflect.TypeFor[pipeline.Hooks](),
		"KafkaSecurity": reflect.TypeFor[pipeline.KafkaSecurity](),
	} {
		doc, ok := docs[alias]
		if !ok {
			t.Errorf("once.%s: no alias with a doc comment in api.go", alias)
			continue
		}
		var listed, fields []string
		for _, m := range listedField.FindAllStringSubmatch(doc, -1) {
			listed = append(listed, strings.Split(m[1], ", ")...)
		}
		for i := range typ.NumField() {
			if typ.Field(i).IsExported() {
				fields = append(fields, typ.Field(i).Name)
			}
		}
		for _, name := range fields {
			if !slices.Contains(listed, name) {
				t.Errorf("once.%s's doc does not list field %s of %s", alias, name, typ)
			}
		}
		for _, name := range listed {
			if !slices.Contains(fields, name) {
				t.Errorf("once.%s's doc lists %s, which %s has not", alias, name, typ)
			}
		}
	}
}

// Issue 28, item 8b: once.Config.SessionTimeout's doc says what a kill -9
// costs by default, 10s: sarama's, which the pipeline keeps when the
// setting is zero. A sarama that changes it makes the doc wrong.
func TestTheSessionTimeoutsDefaultIsAsDocumented(t *testing.T) {
	if got := sarama.NewConfig().Consumer.Group.Session.Timeout; got != 10*time.Second {
		t.Fatalf("sarama's default session timeout is %s; once.Config.SessionTimeout's doc, docs/operating.md and app serve's --session-timeout say 10s", got)
	}
}
